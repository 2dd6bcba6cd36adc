"""Prefill attention with learned sinks, causal or sliding-window, GQA, ragged batches (Triton).

Semantics (OpenAI's ``gpt_oss.torch.model.sdpa``): per query head h a learned logit ``sinks[h]`` is
appended to every softmax row as an extra column that carries no value; ``sm_scale = 1/sqrt(d)``;
key j is visible to query i iff ``j <= i`` and, on sliding layers, ``i - window < j``.

Layout (packed tokens, as a ragged batch through ``cu_seqlens``):
    q    [T, Hq, D]  bf16    (rows of sequence b are cu_seqlens[b] .. cu_seqlens[b+1]-1)
    k, v [T, Hkv, D] bf16    (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv))
    sinks [Hq]       any float dtype (read as fp32)
    out  [T, Hq, D]  bf16
Positions restart at 0 for each sequence (self-attention over the whole sequence). Decode-shaped
calls (a few new queries against a KV cache) live in ``attention_decode.py``.

The kernel: one program per (query head, block of BLOCK_M queries, sequence). The online softmax
runs in base 2 with fp32 state; its running max starts at the sink (m = sink, l = 1), so the sink is
counted exactly once and a row whose keys are all masked stays finite. KV blocks are visited in up to
three phases: window-edge blocks (masked), blocks every query of the tile sees in full (no mask),
and the diagonal blocks (causal mask); blocks that no query of the tile can see are never loaded.
Query blocks are issued longest-first (causal load balance) and heads vary fastest in the grid, so
the Hq / Hkv programs that share a KV head run side by side and share its tiles through L2.

With ``PrefillConfig.pack = p`` a program takes p query heads of one KV head for BLOCK_M / p
positions, stacked in the tile's rows (tile row r: position m0 + r % (BLOCK_M / p), head
p * pid + r // (BLOCK_M / p)); the K/V tiles it loads then serve p heads. The window default packs 2.

On sm_90, one-sequence causal calls with head_dim 64 go to the warp-specialized Gluon kernel of
attention_ws.py (same semantics and arithmetic; ``WS_ATTENTION``, ``WS_CONFIG``).

Options: ``rope=(cos, sin)`` rotates q inside the kernel (YaRN, see ``rope.py``; k comes rotated);
``PrefillConfig.use_tma`` loads K/V through Hopper tensor descriptors (slower than cp.async pointer
loads here, kept for comparison). In the Triton interpreter (CPU) bf16 arithmetic is wrong, so the
kernel upcasts tiles to fp32 after loading there (``UPCAST``); on the GPU the dots take bf16.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gptoss_fp8.quant.fp8 import cdiv

LOG2E = 1.4426950408889634
# The Gluon warp-specialized kernel (kernels/attention_ws.py) for one-sequence causal calls with
# head_dim 64 on sm_90 (``attention_prefill`` checks the rest), with WS_CONFIG's tiles: three
# consumer warpgroups (192 queries per program), 64-key blocks, 4 stages ran at 460-463 TFLOP/s
# against this kernel's 431-439 at 32768 and 131072 tokens on the H200, 1-2% faster at 8192
# (benchmarks/attn_ws_ab.py, notes/kernels_attention.md, seventh session). False: this kernel.
WS_ATTENTION = True
WS_CONFIG = dict(block_n=64, stages=4, warpgroups=3)


@triton.jit
def _attn_inner(
    acc, l_i, m_i, q,
    K, V,  # USE_TMA: descriptors over [T, Hkv * D]; else pointers at (sequence start, kv head)
    k_row0, kv_col,  # USE_TMA: the sequence's first row and the kv head's first column
    stride_kt, stride_vt,
    offs_m, offs_n, offs_d,
    seqlen, window, qk_scale,
    lo, hi,
    MASK: tl.constexpr,  # False: every key of every block visible; True: causal + window + bounds
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N] key positions in the sequence
        if USE_TMA:
            # Rows past this sequence belong to the next one (or are zero-filled past T): finite
            # values that the causal mask hides, so no bounds mask is needed.
            kt = K.load([k_row0 + start_n, kv_col]).T  # [D, BLOCK_N]
        elif MASK:
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
        if USE_TMA:
            v = V.load([k_row0 + start_n, kv_col])
        elif MASK:
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
def _attn_prefill_kernel(
    Q, K, V, Sinks, Out, CuSeqlens, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,  # sm_scale * log2(e)
    window,  # keys i - window < j <= i are visible; a huge value means plain causal
    num_pid_m,
    total_tokens,  # T: the one sequence's length when not RAGGED
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: bf16 arithmetic is wrong there, compute in fp32
    USE_TMA: tl.constexpr,  # K, V are tensor descriptors (Hopper bulk copies) instead of pointers
    ROPE_Q: tl.constexpr,  # rotate q in-kernel with the Cos/Sin tables [max_pos, HEAD_DIM/2]
    RAGGED: tl.constexpr,  # sequences from CuSeqlens; False: one sequence of total_tokens rows
    PACK: tl.constexpr = 1,  # query heads per program (same KV head): BLOCK_M // PACK positions each
):
    QB: tl.constexpr = BLOCK_M // PACK  # query positions per program
    pid_h = tl.program_id(0)  # heads pid_h * PACK .. pid_h * PACK + PACK - 1
    pid_m = num_pid_m - 1 - tl.program_id(1)  # longest query blocks first
    pid_b = tl.program_id(2)
    if RAGGED:
        seq_start = tl.load(CuSeqlens + pid_b)
        seqlen = tl.load(CuSeqlens + pid_b + 1) - seq_start
    else:  # one sequence of all T rows: no cu_seqlens tensor (building one per call would sync)
        seq_start = 0
        seqlen = total_tokens
    # Row offsets of the sequence in int64 (T * H * D can pass 2^31); offsets inside it stay int32.
    row0 = tl.full([], seq_start, tl.int64)
    m0 = pid_m * QB
    if m0 >= seqlen:
        return
    kv_h = (pid_h * PACK) // GROUP

    # Tile row r: query position m0 + r % QB of head pid_h * PACK + r // QB (heads stacked).
    rows = tl.arange(0, BLOCK_M)
    if PACK == 1:
        offs_m = m0 + rows
        head = pid_h
    else:
        offs_m = m0 + rows % QB
        head = pid_h * PACK + rows // QB
    head_off = head * stride_qh
    if PACK > 1:
        head_off = head_off[:, None]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen

    if ROPE_Q:
        # YaRN rotary on q in registers (positions 0.. of each sequence), rounded to q's dtype once,
        # as the separate kernel's store would: saves that kernel's pass over q (8x k's bytes).
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_j = tl.arange(0, HALF)
        q_row = Q + row0 * stride_qt + offs_m[:, None] * stride_qt + head_off + offs_j[None, :]
        x1 = tl.load(q_row, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(q_row + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
        cs = offs_m[:, None] * HALF + offs_j[None, :]
        c = tl.load(Cos + cs, mask=row_ok[:, None], other=0.0)
        s = tl.load(Sin + cs, mask=row_ok[:, None], other=0.0)
        q = tl.reshape(tl.permute(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (0, 2, 1)), (BLOCK_M, HEAD_DIM))
        if not UPCAST:
            q = q.to(Q.dtype.element_ty)
    else:
        q_ptrs = Q + row0 * stride_qt + offs_m[:, None] * stride_qt + head_off + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + row0 * stride_kt + kv_h * stride_kh
        v_src = V + row0 * stride_vt + kv_h * stride_vh

    sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # scalar, or [BLOCK_M] when packed
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Key ranges (QB is a multiple of BLOCK_N, so m0 is block-aligned):
    #   [lo, full_lo): seen by some queries of the tile only (window edge)   -> masked
    #   [full_lo, m0): seen by every query of the tile                       -> unmasked
    #   [m0, hi):      the diagonal                                          -> masked
    hi = tl.minimum(m0 + QB, seqlen)
    first_key = tl.maximum(m0 - window + 1, 0)  # oldest key the tile's first query sees
    lo = (first_key // BLOCK_N) * BLOCK_N
    full_first = tl.maximum(m0 + QB - window, 0)  # oldest key the tile's last query sees
    full_lo = tl.minimum(tl.cdiv(full_first, BLOCK_N) * BLOCK_N, m0)
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q, k_src, v_src, seq_start, kv_h * HEAD_DIM, stride_kt, stride_vt, offs_m, offs_n, offs_d,
        seqlen, window, qk_scale, lo, full_lo, True, BLOCK_N, UPCAST, USE_TMA,
    )
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q, k_src, v_src, seq_start, kv_h * HEAD_DIM, stride_kt, stride_vt, offs_m, offs_n, offs_d,
        seqlen, window, qk_scale, full_lo, m0, False, BLOCK_N, UPCAST, USE_TMA,
    )
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q, k_src, v_src, seq_start, kv_h * HEAD_DIM, stride_kt, stride_vt, offs_m, offs_n, offs_d,
        seqlen, window, qk_scale, m0, hi, True, BLOCK_N, UPCAST, USE_TMA,
    )

    out = acc / l_i[:, None]
    o_head = head * stride_oh
    if PACK > 1:
        o_head = o_head[:, None]
    o_ptrs = Out + row0 * stride_ot + offs_m[:, None] * stride_ot + o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # K/V through host tensor descriptors (needs k/v contiguous)
    maxnreg: int | None = None  # register cap per thread (more programs per SM), None: compiler's choice
    pack: int = 1  # query heads of one KV head per program, stacked in the tile's rows (GQA packing)


# Per (device kind, sliding?). Swept on the H200, 8192 tokens (benchmarks/notes/kernels_attention.md):
# causal: (128, 64, 8 warps, 3 stages, 128 registers) 1.30 ms; uncapped 8 warps 1.71 ms (153
# registers: one program per SM), (128, 64, 4, 3) 1.39 ms. Window 128: (64, 64, 4, 2) 0.164 ms;
# BLOCK_M 128 0.235 ms (a 64-query tile loads fewer keys that the window hides). The 128-register
# cap on the window tile keeps the 127 registers (4 programs per SM) it was measured with.
# Window with two heads per program (pack 2: 32 positions x 2 heads, 32-key blocks): 0.115 vs
# 0.119 ms at 8192 and 0.416 vs 0.456-0.478 ms at 32768 (fourth session, ``variants``); causal
# with pack 2 (64 positions x 2 heads) was no faster than the default.
# The interpreter gets small tiles (its cost grows with them).
PREFILL_CONFIGS: dict[tuple[str, bool], PrefillConfig] = {
    ("cuda", False): PrefillConfig(128, 64, 8, 3, maxnreg=128),
    ("cuda", True): PrefillConfig(64, 32, 4, 2, maxnreg=128, pack=2),
    ("cpu", False): PrefillConfig(32, 16, 4, 1),
    ("cpu", True): PrefillConfig(32, 16, 4, 1),
}

# Defaults for query heads that the default pack does not divide.
UNPACKED_CONFIGS: dict[tuple[str, bool], PrefillConfig] = {
    key: cfg if cfg.pack == 1 else PrefillConfig(64, 64, 4, 2, maxnreg=128) for key, cfg in PREFILL_CONFIGS.items()
}

_NO_WINDOW = 1 << 30


def default_config(on_gpu: bool, windowed: bool, group: int) -> PrefillConfig:
    """The tile for a causal / sliding-window call with ``group`` query heads per KV head."""
    key = ("cuda" if on_gpu else "cpu", windowed)
    cfg = PREFILL_CONFIGS[key]
    return cfg if group % cfg.pack == 0 else UNPACKED_CONFIGS[key]  # e.g. one query head per KV head


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sliding_window: int = 0,
    sm_scale: float | None = None,
    config: PrefillConfig | tuple | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal (or sliding-window) attention with sinks over a ragged batch of packed sequences.

    q [T, Hq, D] bf16, k/v [T, Hkv, D] bf16 (last dim contiguous), sinks [Hq];
    cu_seqlens int32 [B+1] (None: one sequence of T tokens); max_seqlen: the longest sequence
    (None: read from cu_seqlens, which syncs). sliding_window 0 = full causal.
    Returns out [T, Hq, D] bf16.
    """
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q {q.shape} k {k.shape} v {v.shape}: want [T, H, D]"
    T, Hq, D = q.shape
    assert k.shape == v.shape and k.shape[0] == T and k.shape[2] == D, f"q {q.shape} k {k.shape} v {v.shape}"
    Hkv = k.shape[1]
    assert Hq % Hkv == 0, f"{Hq} query heads not a multiple of {Hkv} kv heads"
    assert D in (16, 32, 64, 128, 256), f"head_dim {D} must be a power of two in 16..256"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dtype == torch.bfloat16, f"{name} dtype {t.dtype}, want bfloat16"
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
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0 or max_seqlen == 0:
        return out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    window = sliding_window if 0 < sliding_window < max_seqlen else _NO_WINDOW
    on_gpu = q.device.type == "cuda"
    if config is None and _ws_ok(q, k, v, ragged, window, rope):
        from gptoss_fp8.kernels.attention_ws import ws_attention_prefill

        return ws_attention_prefill(q, k, v, sinks, out, sm_scale, **WS_CONFIG)
    cfg = PrefillConfig(*config) if config is not None else default_config(on_gpu, window != _NO_WINDOW, Hq // Hkv)
    BLOCK_M, BLOCK_N, pack = cfg.block_m, cfg.block_n, cfg.pack
    assert (Hq // Hkv) % pack == 0, f"pack {pack} must divide the {Hq // Hkv} query heads per kv head"
    assert BLOCK_M % (pack * BLOCK_N) == 0, f"BLOCK_M {BLOCK_M} must be a multiple of pack {pack} x BLOCK_N {BLOCK_N}"
    if rope is not None:
        cos, sin = rope
        assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D // 2, f"rope cos {cos.shape} sin {sin.shape}"
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert cos.shape[0] >= max_seqlen, f"rope tables cover {cos.shape[0]} positions < max_seqlen {max_seqlen}"
        assert cos.device == q.device and sin.device == q.device
    else:
        cos = sin = sinks  # unused
    k_arg, v_arg = k, v
    use_tma = cfg.use_tma and k.is_contiguous() and v.is_contiguous()  # else the pointer path
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_arg = TensorDescriptor.from_tensor(k.view(T, Hkv * D), [BLOCK_N, D])
        v_arg = TensorDescriptor.from_tensor(v.view(T, Hkv * D), [BLOCK_N, D])
    num_pid_m = cdiv(max_seqlen, BLOCK_M // pack)
    grid = (Hq // pack, num_pid_m, B)
    _attn_prefill_kernel[grid](
        q, k_arg, v_arg, sinks, out, cu_seqlens if ragged else sinks, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        sm_scale * LOG2E, window, num_pid_m, T,
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=not on_gpu,
        USE_TMA=use_tma, ROPE_Q=rope is not None, RAGGED=ragged, PACK=pack, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and on_gpu else {}),
    )
    return out


def _ws_ok(q, k, v, ragged, window, rope) -> bool:
    """Whether the Gluon warp-specialized kernel takes this call: one causal sequence, head_dim 64,
    no fused rope, [H, D] contiguous per row with 16-byte aligned rows, an sm_90 GPU."""
    if not WS_ATTENTION or ragged or window != _NO_WINDOW or rope is not None or q.shape[-1] != 64:
        return False
    from gptoss_fp8.kernels import attention_ws

    if not attention_ws.supported(q.device):
        return False
    return all(t.stride(1) == t.shape[2] and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (q, k, v))


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    sliding_window: int = 0,
    sm_scale: float | None = None,
    q_offset: int = 0,
) -> torch.Tensor:
    """Plain-torch attention with sinks for ONE sequence, in fp32 (the spirit of gpt_oss ``sdpa``).

    q [Tq, Hq, D], k/v [Tk, Hkv, D], sinks [Hq]; query t sits at position q_offset + t, key j at j.
    Returns [Tq, Hq, D] in q's dtype.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    G = Hq // Hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    qf = q.float().view(Tq, Hkv, G, D)
    kf, vf = k.float(), v.float()
    logits = torch.einsum("qhgd,khd->hgqk", qf, kf) * sm_scale  # [Hkv, G, Tq, Tk]
    pos_q = torch.arange(Tq, device=q.device)[:, None] + q_offset
    pos_k = torch.arange(Tk, device=q.device)[None, :]
    hidden = pos_k > pos_q
    if sliding_window:
        hidden |= pos_k <= pos_q - sliding_window
    logits = logits.masked_fill(hidden, float("-inf"))
    s = sinks.float().view(Hkv, G, 1, 1).expand(Hkv, G, Tq, 1)
    w = torch.softmax(torch.cat([logits, s], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hgqk,khd->qhgd", w, vf)
    return out.reshape(Tq, Hq, D).to(q.dtype)


def attention_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    sliding_window: int = 0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``attention_prefill``'s contract computed sequence by sequence with ``attention_ref``."""
    if cu_seqlens is None:
        return attention_ref(q, k, v, sinks, sliding_window, sm_scale)
    cu = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            out[s:e] = attention_ref(q[s:e], k[s:e], v[s:e], sinks, sliding_window, sm_scale)
    return out

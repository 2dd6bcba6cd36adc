"""YaRN rotary embedding for q and k in one small Triton kernel (gpt-oss's ``RotaryEmbedding``).

gpt-oss rotates the two HALVES of each head (x1 = x[..., :D/2], x2 = x[..., D/2:]):
    o1 = x1 cos - x2 sin,   o2 = x2 cos + x1 sin,
with angle(pos, j) = pos * inv_freq[j] and cos/sin multiplied by the YaRN concentration
0.1 ln(factor) + 1; inv_freq blends interpolation (1 / (factor * base^(2j/D))) and extrapolation
(1 / base^(2j/D)) with the NTK-by-parts ramp. ``gptoss_fp8.spec.rope_table`` builds the cos/sin
table exactly as the reference does (fp32, torch), once per model; the kernel gathers its rows by position, so any
positions work (ragged batches, decode at the end of a cache). Arithmetic is fp32, rounded once
to bf16 at the store (the reference rounds cos/sin to bf16 and computes in bf16: they differ by
bf16 noise; ``spec.apply_rope(..., dtype=torch.float32)`` is this kernel's arithmetic). Every kernel that
rotates (this one, the decode step's rope + append, q's rope fused into the FP8 quantization and into the window
attention) computes the pair by ``rotate`` (one explicit FMA and one product each): left to the compiler, ``x1 c - x2 s``
was contracted differently from kernel to kernel on the GPU (which product is rounded), so a rotation fused into
another kernel was not bit-equal to this one's (the thirty-first session's failing FP8 test); the interpreter fuses
nothing, the same bits as before there.

Layout: q [T, Hq, D], k [T, Hkv, D], any row/head strides with a contiguous last dim (views into a
fused qkv projection output work), positions int32/int64 [T], cos/sin fp32 [max_pos, D/2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait
from gptoss_fp8.quant.fp8 import cdiv, next_pow2


@triton.jit
def rotate(x1, x2, c, s):
    """(x1 c - x2 s, x2 c + x1 s) in fp32, each one FMA over the other product rounded: the same bits in every kernel."""
    return tl.fma(x1, c, -(x2 * s)), tl.fma(x2, c, x1 * s)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, Pos, Cos, Sin,
    T, HQ, HKV,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Heads are numbered 0 .. HQ+HKV-1 across q then k, so one launch rotates both: each element
    # picks its tensor's pointer (q for h < HQ, else k).
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, HALF)
    t_ok = offs_t < T
    pos = tl.load(Pos + offs_t, mask=t_ok, other=0)
    cs_off = pos[:, None].to(tl.int64) * HALF + offs_j[None, :]  # [BLOCK_T, HALF]
    c = tl.load(Cos + cs_off, mask=t_ok[:, None], other=0.0)[:, None, :]
    s = tl.load(Sin + cs_off, mask=t_ok[:, None], other=0.0)[:, None, :]

    t3 = offs_t.to(tl.int64)[:, None, None]  # T * H * D can pass 2^31
    h3 = offs_h[None, :, None]
    j3 = offs_j[None, None, :]
    is_q = h3 < HQ
    ok = t_ok[:, None, None] & (offs_h < HQ + HKV)[None, :, None]
    hk = h3 - HQ
    x_ptr = tl.where(is_q, Q + t3 * stride_qt + h3 * stride_qh, K + t3 * stride_kt + hk * stride_kh) + j3
    y_ptr = tl.where(is_q, QOut + t3 * stride_qot + h3 * stride_qoh, KOut + t3 * stride_kot + hk * stride_koh) + j3
    x1 = tl.load(x_ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rotate(x1, x2, c, s)
    tl.store(y_ptr, o1.to(QOut.dtype.element_ty), mask=ok)
    tl.store(y_ptr + HALF, o2.to(QOut.dtype.element_ty), mask=ok)


def _check(name: str, x: torch.Tensor, T: int, D: int) -> None:
    assert x.dim() == 3 and x.shape[0] == T and x.shape[2] == D, f"{name} {tuple(x.shape)}: want [{T}, H, {D}]"
    assert x.stride(-1) == 1, f"{name} last dim not contiguous (strides {x.stride()})"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{name} dtype {x.dtype}"


def rope_qk(
    q: torch.Tensor | None,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their token positions [T] (one launch).

    cos/sin fp32 [max_pos, D/2] from ``spec.rope_table``; every position must be < max_pos.
    inplace=True writes into q and k (strided views allowed) and returns them.
    q None: k alone (when the attention kernel rotates q itself); returns (None, k_out).
    """
    k_only = q is None
    if k_only:
        q = k[:, :0]  # no heads: every program of the launch works on k
    T, _, D = q.shape
    _check("q", q, T, D)
    _check("k", k, T, D)
    assert D % 2 == 0 and next_pow2(D // 2) == D // 2, f"head_dim {D}: D/2 must be a power of two"
    assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64), (
        f"positions {positions.dtype} {positions.shape}: want int32/int64 [{T}]"
    )
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D // 2, f"cos {cos.shape} sin {sin.shape}"
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert q.dtype == k.dtype, f"q {q.dtype} and k {k.dtype} must share a dtype"
    for name, t in (("k", k), ("positions", positions), ("cos", cos), ("sin", sin)):
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return (None if k_only else q_out), k_out
    Hq, Hkv = q.shape[1], k.shape[1]
    BLOCK_H = min(8, next_pow2(Hq + Hkv))
    BLOCK_T = 4
    grid = (cdiv(T, BLOCK_T), cdiv(Hq + Hkv, BLOCK_H))
    _rope_kernel[grid](
        q, k, q_out, k_out, positions, cos, sin,
        T, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HALF=D // 2, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return (None if k_only else q_out), k_out


@triton.jit
def _rope_append_kernel(
    Q, K, V, QOut, KC, VC, Pos, Slot, Cos, Sin,
    HQ, HKV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh,
    stride_kcb, stride_kcr, stride_kch, stride_vcb, stride_vcr, stride_vch,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per (token, block of heads); heads 0 .. HQ + 2 HKV - 1 number q, then k, then v
    # (v copied unrotated). Token t is sequence t of the cache: k and v go to row Slot[t].
    pdl_wait(PDL)  # everything read here is the step's own (positions, slots, cos / sin rows, q / k / v)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, HALF)
    pos = tl.load(Pos + t).to(tl.int64)
    row = tl.load(Slot + t).to(tl.int64)
    c = tl.load(Cos + pos * HALF + offs_j)[None, :]
    s = tl.load(Sin + pos * HALF + offs_j)[None, :]
    h2 = offs_h[:, None]
    j2 = offs_j[None, :]
    is_q = h2 < HQ
    is_k = (h2 >= HQ) & (h2 < HQ + HKV)
    is_v = h2 >= HQ + HKV
    ok = (h2 < HQ + 2 * HKV) & (j2 < HALF)
    hk = h2 - HQ
    hv = h2 - HQ - HKV
    src = tl.where(is_q, Q + t * stride_qt + h2 * stride_qh,
                   tl.where(is_k, K + t * stride_kt + hk * stride_kh, V + t * stride_vt + hv * stride_vh)) + j2
    dst = tl.where(is_q, QOut + t * stride_qot + h2 * stride_qoh,
                   tl.where(is_k, KC + t * stride_kcb + row * stride_kcr + hk * stride_kch,
                            VC + t * stride_vcb + row * stride_vcr + hv * stride_vch)) + j2
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    r1, r2 = rotate(x1, x2, c, s)
    o1 = tl.where(is_v, x1, r1)
    o2 = tl.where(is_v, x2, r2)
    tl.store(dst, o1.to(QOut.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, o2.to(QOut.dtype.element_ty), mask=ok)


def rope_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode step's q / k / v in one launch: q [B, Hq, D] rotated into a new tensor (returned),
    k [B, Hkv, D] rotated and v [B, Hkv, D] as it is written to row ``slots[b]`` of sequence b of
    the layer's cache (k_cache / v_cache [B, rows, Hkv, D], the cache's dtype = q's).

    Same arithmetic as ``rope_qk`` (fp32, one rounding at the store); v's bits are copied. So the
    cache holds exactly what ``rope_qk`` then an indexed store would put there (model/cache.py
    ``KVCache.append``). positions int [B] index cos / sin fp32 [max_pos, D/2]; slots int [B]
    (< rows; not checked on the device). ``pdl``: programmatic dependent launch (kernels/pdl.py)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    _check("q", q, B, D)
    _check("k", k, B, D)
    _check("v", v, B, D)
    assert v.shape[1] == Hkv, f"v {tuple(v.shape)} does not match k {tuple(k.shape)}"
    assert D % 2 == 0 and next_pow2(D // 2) == D // 2, f"head_dim {D}: D/2 must be a power of two"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.dim() == 4 and c.shape[0] == B and c.shape[2:] == (Hkv, D) and c.stride(-1) == 1, (
            f"{name} {tuple(c.shape)}: want [{B}, rows, {Hkv}, {D}] with a contiguous last dim")
        assert c.dtype == q.dtype, f"{name} {c.dtype}, q {q.dtype}: one dtype"
    assert q.dtype == k.dtype == v.dtype, f"q {q.dtype}, k {k.dtype}, v {v.dtype} must share a dtype"
    assert positions.shape == (B,) and slots.shape == (B,), (
        f"positions {tuple(positions.shape)} / slots {tuple(slots.shape)}: want [{B}]")
    assert positions.dtype in (torch.int32, torch.int64) and slots.dtype in (torch.int32, torch.int64)
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D // 2, f"cos {cos.shape} sin {sin.shape}"
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return q_out
    heads = Hq + 2 * Hkv
    BLOCK_H = min(32, next_pow2(heads))
    _rope_append_kernel[(B, cdiv(heads, BLOCK_H))](
        q, k, v, q_out, k_cache, v_cache, positions, slots, cos, sin,
        Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=D // 2, BLOCK_H=BLOCK_H, PDL=pdl, num_warps=4, **launch_kwargs(pdl),
    )
    return q_out

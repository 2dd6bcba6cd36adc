"""FP8 attention operands in one pass over Q, K, V (Triton): quant/attn_fp8.py's roundings, fused.

Contract (reference: ``gptoss_fp8.quant.attn_fp8``, which owns the layouts and the rounding rules)
* ``quantize_qk(x [T, H, D])`` -> (x8 float8_e4m3fn [T, H, D] contiguous, scale float32 [H, ceil(T/64)]
  contiguous): one scale per (head, 64-row block), max(amax, ACT_EPS) / fp8_max over the block's
  64 x D values (rows >= T ignored), x8 = rne(x / scale) saturated at +-fp8_max.
* ``quantize_v(v [T, H, D], key_order=None, pad_to=1)`` -> (v8t float8_e4m3fn [H, D, Tout], scale
  float32 [H, D]): one scale per (head, channel) over all T rows; V transposed (keys contiguous),
  Tout = T rounded up to a multiple of ``pad_to``, the padded keys zero. With ``key_order`` (int64
  [64], a permutation; pad_to a multiple of 64) position k of each 64-key block holds key
  block_start + key_order[k]: the Gluon FP8 kernel's P operand order (attention_ws_fp8.key_order).
  A CPU key_order for a CUDA v is checked and copied to the device once (cached).
Inputs: bf16 / fp16 / fp32, any stride over T and H (e.g. q, k, v as views of a fused qkv buffer),
D contiguous, a power of two in 16..256 (attention.py's range).

Rounding: as kernels/act_quant.py (``e4m3``: the hardware cast on the GPU, ``round_to_e4m3`` before it in
the interpreter), plus the sign of zero: a negative value that rounds to zero gives -0 (byte 0x80) as torch's cast
does, so the bytes, not only the values, equal the reference's. V's scale comes from a partial-amax
kernel and torch's own ops on the [H, D] amax (the reference's ops on the same exact values).

Division: unlike act_quant.py, the quotients x / scale use ``tl.math.div_rn`` (IEEE, as torch's
tensor-by-tensor division on either device). With Triton's ``/`` (not IEEE-rounded on the GPU), bf16
inputs, whose quotients often fall on an e4m3 rounding tie, put up to 3 of 12800 values (2e-4) one
step from the GPU reference's on an H200, past act_quant's bound; with div_rn all of
tests/kernels/test_attn_quant.py passed there (2026-12-04, T up to 131072), at the same speed (0.46
ms for Q at 128000 tokens, 64 heads, memory-bound either way). The Q / K scale max(amax, eps) /
fp8_max is a Triton division by a constant, torch's CUDA reference a multiplication by the
reciprocal: those scales may differ by 1 fp32 ulp on the GPU (as act_quant's).

Exactness: in the interpreter (CPU) scales and bytes equal the reference's. On the GPU, against the
reference run there: V's scales equal (the same torch ops), its bytes equal up to the division (IEEE
on both sides); Q and K scales within 1 ulp. The tests hold the GPU to act_quant's tolerance.
(torch's reference itself differs between CPU and GPU by that ulp of the Q / K scales.)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels import device_ints
from gptoss_fp8.kernels.act_quant import SOFT_E4M3, e4m3_saturated, group_scale
from gptoss_fp8.kernels.rope import rotate
from gptoss_fp8.quant.attn_fp8 import QK_BLOCK
from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_DTYPE, FP8_MAX, cdiv, next_pow2

KEY_BLOCK = 64  # keys per key_order block
V_CHUNK = 1024  # rows per program of V's partial amax
V_BLOCK_T = 64  # keys per program of V's quantization (a multiple of KEY_BLOCK)


@triton.jit
def _e4m3_saturated(q, FP8_MAX_C: tl.constexpr):
    """fp32 quotients -> their e4m3 values (RNE, saturated at +-FP8_MAX_C), -0 kept (act_quant.e4m3: on the GPU
    the hardware cast, which keeps it; in the interpreter fp32 values, the sign put back)."""
    r = e4m3_saturated(q, FP8_MAX_C)
    if SOFT_E4M3:
        # round_to_e4m3's subnormal path returns +0 for a tiny negative; torch's cast gives -0 (0x80)
        sign = q.to(tl.int32, bitcast=True) & -2147483648  # -2147483648 == 0x80000000 as int32
        r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return r


@triton.jit
def _quantize_qk_kernel(
    x_ptr, q_ptr, s_ptr, cos_ptr, sin_ptr, T, H, NB, stride_xt, stride_xh, pos0,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, ROPE: tl.constexpr = False,
    blk_ptr=None, BLOCKED: tl.constexpr = False, HEADS_FAST: tl.constexpr = False,
    n_ptr=None, NORMS: tl.constexpr = False,
):
    """One program per (64-row block, BLOCK_H heads): tile [BLOCK_T, BLOCK_H, D], one scale per head.
    HEADS_FAST (not BLOCKED): the grid is (head groups, row blocks), a row block's programs one after another (its
    rope rows read once from L2 for all its heads), else (row blocks, head groups).
    ROPE: x not yet rotated: each head's halves rotated first (row t at position pos0 + t of the cos /
    sin tables [max_pos, D/2]), kernels/rope.py's fp32 arithmetic rounded once to x's dtype, so the
    bytes are those of quantizing rope_qk's output (its store not made).
    BLOCKED (no ROPE): program b's block is the int32 row (first source row, rows, first output row) b of blk_ptr
    [NB, 3] (``quantize_qk_blocks``: the blocks of several row ranges), its scale column b.
    NORMS: also each head's largest row norm of the block's e4m3 values, sqrt(sum of squares) in e4m3 units, into
    n_ptr [H, NB] (the FP8 attention's ``exp_lin`` bound on the scores; ``attention_ws_fp8.key_norms``)."""
    if HEADS_FAST:
        pid_b = tl.program_id(1)
        pid_h = tl.program_id(0)
    else:
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
    if BLOCKED:
        r = tl.arange(0, BLOCK_T)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        rows = (tl.load(blk_ptr + 3 * pid_b).to(tl.int64) + r)[:, None, None]
        out_rows = (tl.load(blk_ptr + 3 * pid_b + 2).to(tl.int64) + r)[:, None, None]
        heads = offs_h.to(tl.int64)[None, :, None]
        mask = (r < tl.load(blk_ptr + 3 * pid_b + 1))[:, None, None] & (heads < H)
    else:
        offs_t = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        rows = offs_t.to(tl.int64)[:, None, None]
        out_rows = rows
        heads = offs_h.to(tl.int64)[None, :, None]  # int64 offsets: any stride over T and H
        mask = (offs_t < T)[:, None, None] & (heads < H)
    if ROPE:
        HALF: tl.constexpr = D // 2
        offs_j = tl.arange(0, HALF)[None, None, :]
        x_ptrs = x_ptr + rows * stride_xt + heads * stride_xh + offs_j
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        cs = (offs_t.to(tl.int64) + pos0)[:, None, None] * HALF + offs_j
        c = tl.load(cos_ptr + cs, mask=(offs_t < T)[:, None, None], other=0.0)
        s = tl.load(sin_ptr + cs, mask=(offs_t < T)[:, None, None], other=0.0)
        dt = x_ptr.dtype.element_ty
        o1, o2 = rotate(x1, x2, c, s)  # rope_qk's arithmetic and its one rounding
        o1 = o1.to(dt).to(tl.float32)
        o2 = o2.to(dt).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(o1), axis=2), axis=0), tl.max(tl.max(tl.abs(o2), axis=2), axis=0))
        scale = group_scale(amax, FP8_MAX_C, EPS)  # [BLOCK_H]
        q1 = _e4m3_saturated(tl.math.div_rn(o1, scale[None, :, None]), FP8_MAX_C)
        q2 = _e4m3_saturated(tl.math.div_rn(o2, scale[None, :, None]), FP8_MAX_C)
        q_ptrs = q_ptr + rows * (H * D) + heads * D + offs_j
        tl.store(q_ptrs, q1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptrs + HALF, q2.to(q_ptr.dtype.element_ty), mask=mask)
        if NORMS:  # (masked rows hold zeros; e4m3 on the GPU, fp32 values in the interpreter)
            q1f = q1.to(tl.float32)
            q2f = q2.to(tl.float32)
            ss = tl.sum(q1f * q1f, axis=2) + tl.sum(q2f * q2f, axis=2)
            tl.store(n_ptr + offs_h * NB + pid_b, tl.sqrt(tl.max(ss, axis=0)), mask=offs_h < H)
    else:
        offs_d = tl.arange(0, D)
        x = tl.load(x_ptr + rows * stride_xt + heads * stride_xh + offs_d[None, None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        scale = group_scale(tl.max(tl.max(tl.abs(x), axis=2), axis=0), FP8_MAX_C, EPS)  # [BLOCK_H]
        q = _e4m3_saturated(tl.math.div_rn(x, scale[None, :, None]), FP8_MAX_C)  # IEEE, as torch's
        tl.store(q_ptr + out_rows * (H * D) + heads * D + offs_d[None, None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if NORMS:  # (masked rows hold zeros; q is e4m3 on the GPU, fp32 values in the interpreter)
            qf = q.to(tl.float32)
            tl.store(n_ptr + offs_h * NB + pid_b, tl.sqrt(tl.max(tl.sum(qf * qf, axis=2), axis=0)), mask=offs_h < H)
    tl.store(s_ptr + offs_h * NB + pid_b, scale, mask=offs_h < H)


@triton.jit
def _v_amax_kernel(
    v_ptr, amax_ptr, T, H, stride_vt, stride_vh,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
    blk_ptr=None, BLOCKED: tl.constexpr = False,
):
    """One program per (CHUNK rows, head): amax over the chunk's rows per channel -> amax [n_chunks, H, D].
    BLOCKED: program c's rows are blk_ptr's int32 row c (first row, rows, -, -) of [n_chunks, 4]."""
    pid_c = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    if BLOCKED:
        t_start = tl.load(blk_ptr + 4 * pid_c)
        t_end = t_start + tl.load(blk_ptr + 4 * pid_c + 1)
    else:
        t_start = pid_c * CHUNK
        t_end = tl.minimum(pid_c * CHUNK + CHUNK, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        ptrs = v_ptr + offs_t.to(tl.int64)[:, None] * stride_vt + h.to(tl.int64) * stride_vh + offs_d[None, :]
        x = tl.load(ptrs, mask=(offs_t < t_end)[:, None], other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(amax_ptr + (pid_c * H + h) * D + offs_d, tl.max(acc, axis=0))


@triton.jit
def _quantize_v_kernel(
    v_ptr, s_ptr, order_ptr, out_ptr, T, T_OUT, stride_vt, stride_vh,
    BLOCK_T: tl.constexpr, KEY_BLOCK: tl.constexpr, D: tl.constexpr, ORDERED: tl.constexpr,
    FP8_MAX_C: tl.constexpr, blk_ptr=None, BLOCKED: tl.constexpr = False,
):
    """One program per (BLOCK_T output keys, head): tile [D, BLOCK_T] gathered from V's rows in
    key_order (a transposed load), quantized by channel, stored as a plain tile of v8t [H, D, T_OUT].
    BLOCKED (not ORDERED): program b's keys are blk_ptr's int32 row b (first source row, rows, first output
    key, segment) of [n_blocks, 4], quantized with the segment's scales s_ptr [segments, H, D]."""
    pid_b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_T)
    if BLOCKED:
        t_src = tl.load(blk_ptr + 4 * pid_b).to(tl.int64) + offs_k
        t_dst = tl.load(blk_ptr + 4 * pid_b + 2).to(tl.int64) + offs_k
        n_valid = tl.load(blk_ptr + 4 * pid_b + 1)
        s_row = tl.load(blk_ptr + 4 * pid_b + 3) * tl.num_programs(1) + h  # (the grid's heads)
    else:
        if ORDERED:
            src = (offs_k // KEY_BLOCK) * KEY_BLOCK + tl.load(order_ptr + offs_k % KEY_BLOCK)
        else:
            src = offs_k
        t_src = pid_b * BLOCK_T + src
        t_dst = pid_b * BLOCK_T + offs_k
        s_row = h
    offs_d = tl.arange(0, D)
    # keys T..T_OUT load as zeros and quantize to zero: the padding
    ptrs = v_ptr + t_src.to(tl.int64)[None, :] * stride_vt + h.to(tl.int64) * stride_vh + offs_d[:, None]
    if BLOCKED:
        valid = offs_k < n_valid
    else:
        valid = t_src < T
    x = tl.load(ptrs, mask=valid[None, :], other=0.0).to(tl.float32)  # [D, BLOCK_T]
    scale = tl.load(s_ptr + s_row * D + offs_d)
    q = _e4m3_saturated(tl.math.div_rn(x, scale[:, None]), FP8_MAX_C)
    rows = (h * D + offs_d).to(tl.int64)[:, None]
    tl.store(out_ptr + rows * T_OUT + t_dst[None, :], q.to(out_ptr.dtype.element_ty), mask=(t_dst < T_OUT)[None, :])


def _check_input(x: torch.Tensor, name: str) -> None:
    assert x.dim() == 3, f"{name} {tuple(x.shape)}: want [T, H, D]"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{name} {tuple(x.shape)}: dtype {x.dtype}"
    d = x.shape[2]
    assert 16 <= d <= 256 and d & (d - 1) == 0, f"{name} {tuple(x.shape)}: head_dim {d} not a power of two in 16..256"
    assert x.stride(2) == 1, f"{name} {tuple(x.shape)} strides {x.stride()}: head_dim must be contiguous"


_ORDERS: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # (device, order) -> the order there


def _order_on(order: torch.Tensor, device: torch.device) -> torch.Tensor:
    """key_order on v's device. A CPU order is checked to be a permutation and copied to a GPU once
    (the launcher's ~20 tiny ops and a host-to-device copy per call cost more than the V kernels at
    8192 tokens); one already on the GPU is taken unchecked (checking would wait for the GPU)."""
    if order.device.type != "cpu":
        assert order.device == device, f"key_order on {order.device}, v on {device}"
        return order
    keys = tuple(order.tolist())
    assert sorted(keys) == list(range(KEY_BLOCK)), f"key_order {list(keys)}: not a permutation of 0..{KEY_BLOCK - 1}"
    if device.type == "cpu":
        return order
    key = (str(device), keys)
    if key not in _ORDERS:
        _ORDERS[key] = order.to(device)
    return _ORDERS[key]


def qk_tile(h: int, d: int, rope: bool) -> tuple[int, int, bool]:
    """``quantize_qk``'s launch: (heads a program, warps, heads fastest in the grid). One head of 64 rows a program,
    8 warps, a row block's heads one after another (its rope rows then read from L2 once): H100, q of 64 heads with
    its rope at 32768 / 128000 tokens 0.1756 / 0.6492 ms (2.3-2.4 TB/s) against 0.3014 / 1.0871 for the four heads a
    program of 4 warps, row blocks fastest, before the thirty-eighth session (k 0.0251 / 0.0743 against 0.0329 /
    0.0891; benchmarks/qk_quant_sweep.py, the same bytes)."""
    return 1, 8 if d >= 64 else 4, True


def quantize_qk(x: torch.Tensor, fp8_max: float = FP8_MAX, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                pos0: int = 0, tile: tuple[int, int, bool] | None = None,
                norms: bool = False) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (x8 e4m3 [T, H, D], scale fp32 [H, ceil(T/64)]): ``attn_fp8.quantize_qk``, one launch.
    rope = (cos, sin) fp32 [max_pos, D/2] contiguous: x not yet rotated; row t is rotated at position
    pos0 + t first, as kernels/rope.py's ``rope_qk`` would store it (``spec.apply_rope(...,
    dtype=torch.float32)``): the same bytes as quantizing that, without writing the rotated x.
    tile = (heads a program, warps, heads fastest in the grid): the launch's shape (the same bytes whatever it is;
    measurement, benchmarks/qk_quant_sweep.py); None: ``qk_tile``. norms: also each 64-row block's largest row norm
    of its e4m3 values per head, fp32 [H, ceil(T/64)] (``attention_ws_fp8.key_norms``' values, summed in another
    order), returned third."""
    _check_input(x, "x")
    t, h, d = x.shape
    if rope is not None:
        cos, sin = rope
        assert cos.shape == sin.shape and cos.shape[1:] == (d // 2,) and cos.shape[0] >= pos0 + t, (
            f"rope tables {tuple(cos.shape)} for {t} rows at positions {pos0}..")
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert cos.device == x.device and sin.device == x.device
    nb = cdiv(t, QK_BLOCK)
    x8 = torch.empty((t, h, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((h, nb), dtype=torch.float32, device=x.device)
    n = torch.empty((h, nb), dtype=torch.float32, device=x.device) if norms else None
    if t == 0 or h == 0:
        return (x8, scale, n) if norms else (x8, scale)
    block_h, warps, heads_fast = tile or qk_tile(h, d, rope is not None)
    heads_fast = heads_fast and nb < 65536  # (a grid's second dimension holds at most 65535 row blocks)
    grid = (cdiv(h, block_h), nb) if heads_fast else (nb, cdiv(h, block_h))
    cos, sin = rope if rope is not None else (scale, scale)  # (unread without rope)
    _quantize_qk_kernel[grid](
        x, x8, scale, cos, sin, t, h, nb, x.stride(0), x.stride(1), pos0,
        BLOCK_T=QK_BLOCK, BLOCK_H=block_h, D=d, FP8_MAX_C=fp8_max, EPS=ACT_EPS, num_warps=warps,
        **({"ROPE": True} if rope is not None else {}), **({"HEADS_FAST": True} if heads_fast else {}),
        **({"n_ptr": n, "NORMS": True} if norms else {}),
    )
    return (x8, scale, n) if norms else (x8, scale)


def quantize_qk_blocks(x: torch.Tensor, blocks: torch.Tensor, rows_out: int,
                       fp8_max: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_qk`` of several row ranges of x [N, H, D] in one launch, each range's 64-row blocks counted from
    its own first row: blocks int32 [NB, 3] on x's device, one row per block (first row in x, rows 1..64, first row
    of the output) -> (x8 e4m3 [rows_out, H, D], scale fp32 [H, NB], column b block b's). Output rows no block
    writes are left as they are (uninitialised). ``SegmentPlan`` makes the tables."""
    _check_input(x, "x")
    _, h, d = x.shape
    nb = blocks.shape[0]
    assert blocks.dtype == torch.int32 and blocks.shape == (nb, 3) and blocks.is_contiguous(), (
        f"blocks {blocks.dtype} {tuple(blocks.shape)}: want contiguous int32 [NB, 3]")
    assert blocks.device == x.device, f"blocks on {blocks.device}, x on {x.device}"
    x8 = torch.empty((rows_out, h, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((h, nb), dtype=torch.float32, device=x.device)
    if nb == 0 or h == 0:
        return x8, scale
    block_h = min(next_pow2(h), max(1, 256 // d))
    _quantize_qk_kernel[(nb, cdiv(h, block_h))](
        x, x8, scale, scale, scale, 0, h, nb, x.stride(0), x.stride(1), 0,
        BLOCK_T=QK_BLOCK, BLOCK_H=block_h, D=d, FP8_MAX_C=fp8_max, EPS=ACT_EPS, num_warps=4,
        blk_ptr=blocks, BLOCKED=True,
    )
    return x8, scale


def quantize_v_segments(v: torch.Tensor, chunks: torch.Tensor, chunk_segment: torch.Tensor, blocks: torch.Tensor,
                        segments: int, keys_out: int, fp8_max: float = FP8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_v`` of several row ranges (segments) of v [N, H, D] in one pass, each with its own channel scales:
    chunks int32 [NC, 4] (first row, rows <= V_CHUNK, -, -) cover each segment's rows, chunk_segment int64 [NC]
    their segments; blocks int32 [NB, 4] (first source row, rows 1..64, first output key, segment) -> (v8t e4m3
    [H, D, keys_out], each block's 64 keys from its output key on, the keys past its rows zero; scale fp32
    [segments, H, D]). Keys no block writes are left as they are. ``SegmentPlan`` makes the tables."""
    _check_input(v, "v")
    _, h, d = v.shape
    for name, t, w in (("chunks", chunks, 4), ("blocks", blocks, 4)):
        assert t.dtype == torch.int32 and t.dim() == 2 and t.shape[1] == w and t.is_contiguous(), (
            f"{name} {t.dtype} {tuple(t.shape)}: want contiguous int32 [n, {w}]")
        assert t.device == v.device, f"{name} on {t.device}, v on {v.device}"
    partial = torch.empty((chunks.shape[0], h, d), dtype=torch.float32, device=v.device)
    v8t = torch.empty((h, d, keys_out), dtype=FP8_DTYPE, device=v.device)
    if chunks.shape[0]:
        _v_amax_kernel[(chunks.shape[0], h)](
            v, partial, 0, h, v.stride(0), v.stride(1), CHUNK=V_CHUNK, BLOCK_T=64, D=d, num_warps=4,
            blk_ptr=chunks, BLOCKED=True,
        )
    # each segment's amax from its chunks' (exact), then quantize_v's own ops on it
    amax = torch.zeros((segments, h, d), dtype=torch.float32, device=v.device)
    amax.scatter_reduce_(0, chunk_segment[:, None, None].expand_as(partial), partial, "amax")
    scale = amax.clamp(min=ACT_EPS) / fp8_max
    if blocks.shape[0]:
        _quantize_v_kernel[(blocks.shape[0], h)](
            v, scale, scale, v8t, 0, keys_out, v.stride(0), v.stride(1),
            BLOCK_T=KEY_BLOCK, KEY_BLOCK=KEY_BLOCK, D=d, ORDERED=False, FP8_MAX_C=fp8_max, num_warps=4,
            blk_ptr=blocks, BLOCKED=True,
        )
    return v8t, scale


def _blocks(lengths: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranges of ``lengths`` cut into blocks of ``size``: (each block's range, its first offset in the range)."""
    counts = -(-lengths // size)
    i = np.repeat(np.arange(len(lengths)), counts)
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]
    return i, (np.arange(len(i)) - first[i]) * size


class SegmentPlan:
    """The FP8 operands' block tables for several sequences' prompt chunks after their cached keys (the serving
    step's ``attention_segments`` under ``--attention fp8``), each chunk quantized as ``spec.attention_fp8`` of that
    chunk alone would: its query rows in 64-row blocks from its first row; its keys (rows starts[i] .. starts[i] +
    offsets[i] + n_i - 1 of the key tensor, a KV cache's [batch * rows] view) in 64-key blocks from its first key,
    copied to ``k_starts8[i]``.. of packed operands where each chunk's keys start at a multiple of 64; V's channel
    scales over each chunk's keys. Host ints in (``rows`` [B + 1] the chunks' query rows, ``starts``, ``offsets``
    [B]); one host-to-device copy (from pinned memory on CUDA: no sync)."""

    def __init__(self, rows: list[int], starts: list[int], offsets: list[int], device: torch.device | str):
        assert len(rows) == len(starts) + 1 == len(offsets) + 1, f"rows {rows} starts {starts} offsets {offsets}"
        r, k0, off = np.asarray(rows, np.int64), np.asarray(starts, np.int64), np.asarray(offsets, np.int64)
        n = r[1:] - r[:-1]
        bad = np.flatnonzero((n <= 0) | (off < 0) | (k0 < 0))
        assert not len(bad), f"chunk {bad[0]}: rows {r[bad[0]]}..{r[bad[0] + 1]}, keys from row {k0[bad[0]]}, offset " \
                             f"{off[bad[0]]}"
        nk = off + n
        k8 = np.concatenate([[0], np.cumsum(-(-nk // QK_BLOCK) * QK_BLOCK)])  # each chunk's first packed key
        i, j = _blocks(n, QK_BLOCK)
        q_blocks = np.stack([r[i] + j, np.minimum(QK_BLOCK, n[i] - j), r[i] + j], 1)
        q_base = np.concatenate([[0], np.cumsum(-(-n // QK_BLOCK))])[:-1]
        i, j = _blocks(nk, QK_BLOCK)  # (= KEY_BLOCK: V's blocks are K's)
        rest = np.minimum(QK_BLOCK, nk[i] - j)
        k_blocks = np.stack([k0[i] + j, rest, k8[i] + j], 1)
        v_blocks = np.stack([k0[i] + j, rest, k8[i] + j, i], 1)
        i, j = _blocks(nk, V_CHUNK)
        v_chunks = np.stack([k0[i] + j, np.minimum(V_CHUNK, nk[i] - j), 0 * j, 0 * j], 1)
        self.segments, self.keys_out, self.q_rows = len(starts), int(k8[-1]), rows[-1]
        self.key_rows = int((k0 + nk).max(initial=0))  # the key tensor's rows the chunks read
        tables = [t.astype(np.int32).reshape(-1) for t in (q_blocks, k_blocks, v_chunks, v_blocks, q_base, k8[:-1])]
        t = device_ints(np.concatenate(tables), device, torch.int32)
        q_b, k_b, v_c, v_b, qb, ks = torch.split(t, [x.size for x in tables])
        self.q_blocks, self.k_blocks = q_b.view(-1, 3), k_b.view(-1, 3)
        self.v_chunks, self.v_blocks = v_c.view(-1, 4), v_b.view(-1, 4)
        self.q_scale_base, self.k_starts8 = qb, ks  # int32 [B]: each chunk's first Q scale column, first packed key
        self.chunk_segment = device_ints(i, device)  # int64: the V chunks' segments

    def operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8_max: float = FP8_MAX):
        """q [rows[-1], Hq, D], k / v [N, Hkv, D] -> (q8 [rows[-1], Hq, D], sq [Hq, q blocks], k8 [keys_out, Hkv, D],
        sk [Hkv, keys_out / 64], v8t [Hkv, D, keys_out], sv [B, Hkv, D])."""
        assert q.shape[0] == self.q_rows, f"q {tuple(q.shape)}: the plan's chunks hold {self.q_rows} rows"
        assert k.shape == v.shape and k.shape[0] >= self.key_rows, (
            f"k {tuple(k.shape)} / v {tuple(v.shape)}: the plan's chunks read key rows up to {self.key_rows}")
        q8, sq = quantize_qk_blocks(q, self.q_blocks, q.shape[0], fp8_max)
        k8, sk = quantize_qk_blocks(k, self.k_blocks, self.keys_out, fp8_max)
        v8t, sv = quantize_v_segments(v, self.v_chunks, self.chunk_segment, self.v_blocks, self.segments,
                                      self.keys_out, fp8_max)
        return q8, sq, k8, sk, v8t, sv


def quantize_v(v: torch.Tensor, fp8_max: float = FP8_MAX, key_order: torch.Tensor | None = None,
               pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """v [T, H, D] -> (v8t e4m3 [H, D, Tout], scale fp32 [H, D]): ``attn_fp8.quantize_v`` with T padded
    by zero keys to Tout = a multiple of ``pad_to`` and, with ``key_order``, each 64-key block in that
    order (module docstring). Two launches (partial amax, quantization) and three tiny torch ops."""
    _check_input(v, "v")
    t, h, d = v.shape
    assert t > 0 and h > 0, f"v {tuple(v.shape)}: empty (V's channel scale needs rows)"
    assert pad_to >= 1, f"pad_to {pad_to}"
    if key_order is not None:
        assert key_order.shape == (KEY_BLOCK,) and key_order.dtype == torch.int64, (
            f"key_order {tuple(key_order.shape)} {key_order.dtype}: want int64 [{KEY_BLOCK}]")
        assert pad_to % KEY_BLOCK == 0, f"pad_to {pad_to}: key_order needs whole blocks of {KEY_BLOCK} keys"
        key_order = _order_on(key_order, v.device)
    n_chunks = cdiv(t, V_CHUNK)
    partial = torch.empty((n_chunks, h, d), dtype=torch.float32, device=v.device)
    _v_amax_kernel[(n_chunks, h)](
        v, partial, t, h, v.stride(0), v.stride(1), CHUNK=V_CHUNK, BLOCK_T=64, D=d, num_warps=4,
    )
    # the reference's own ops on the same (exact) amax: bit-identical scales on the GPU too
    scale = partial.amax(0).clamp(min=ACT_EPS) / fp8_max  # [H, D]
    t_out = cdiv(t, pad_to) * pad_to
    v8t = torch.empty((h, d, t_out), dtype=FP8_DTYPE, device=v.device)
    _quantize_v_kernel[(cdiv(t_out, V_BLOCK_T), h)](
        v, scale, scale if key_order is None else key_order, v8t, t, t_out, v.stride(0), v.stride(1),  # (scale: unread)
        BLOCK_T=V_BLOCK_T, KEY_BLOCK=KEY_BLOCK, D=d, ORDERED=key_order is not None, FP8_MAX_C=fp8_max, num_warps=4,
    )
    return v8t, scale

"""RMSNorm, optionally fused with the residual add before it (Triton).

gpt-oss (``gpt_oss/torch/model.py``) normalises in fp32: t = x.float(); t = t * rsqrt(mean(t^2)
+ eps); out = (t * weight).to(x.dtype), with the norm scale held in fp32. Every norm but the first
follows a residual add in the bf16 stream, x = x + delta.to(bf16). ``add_rms_norm`` does both in
one pass over the row (one read of x and delta, one write of the new x and of the normed row),
where torch takes ~8 passes over [T, H] in fp32.

Numerics: the residual sum is rounded to bf16 exactly as torch's bf16 add (fp32 sum, one
rounding); the sum of squares is an fp32 tree reduction (torch's mean: another order) and
``rsqrt`` is the GPU's approximate one: the normed output is within one bf16 ulp of
``gptoss_fp8.spec.rms_norm`` (the reference; ``spec.add_rms_norm`` for the fused add). In Triton's
interpreter (CPU), fp32 -> bf16 stores truncate instead of rounding, which is also within one bf16
ulp.

``quant=True`` also returns the normed rows' FP8 quantization (1x128 groups, kernels/act_quant.py's
contract and arithmetic, on the bf16-rounded output): the same bits as ``act_quant`` of the normed
tensor, without reading it back. The linears and the MoE that follow a norm take it from there.
The row arithmetic (add, norm, quantization, stores) is ``add_rms_norm_rows``, shared with the
norm fused into the skinny GEMM's epilogue (fp8_gemv.py ``fp8_gemm_skinny_add_rms_norm``).

``rms_norm_quant(..., combine=weights)`` takes the MoE's per-slot outputs [T, k, H] as the delta and
combines them in the same pass (``moe.moe_combine``'s arithmetic, bit for bit): the combined
[T, H] delta is never written and read back, and one launch per layer is saved.

Layout: x [T, H] with a contiguous last dim, weight float32 [H] contiguous; the whole row in one
tile (BLOCK_H = next_pow2(H)), so very wide rows (H beyond ~16K) are not what this is for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels.act_quant import e4m3_saturated, group_scale
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait
from gptoss_fp8.quant.fp8 import ACT_EPS, ACT_GROUP, FP8_DTYPE, FP8_MAX, cdiv, next_pow2


@triton.jit
def add_rms_norm_rows(
    x, d, w, rows, cols, mask, M, H, eps, xo_ptr, y_ptr, q_ptr, s_ptr, stride_xo, stride_y, stride_q, stride_s,
    HAS_DELTA: tl.constexpr, QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, STORE_Y: tl.constexpr = True,
    r_ptr=None, STORE_R: tl.constexpr = False,
):
    """The row arithmetic of the norm on loaded rows: x [BLOCK_M, BLOCK_H] (x's dtype; masked
    entries 0), d the delta's rows (any dtype; unused without HAS_DELTA), w float32 [BLOCK_H] the
    norm weight; ``rows`` (int64) / ``cols`` / ``mask`` address the tile in [M, H]. Stores x + d
    (HAS_DELTA) into xo, the normed rows into y (STORE_Y: with QUANT a caller may leave them unwritten),
    (QUANT) their 1x128 FP8 groups into q, s and (STORE_R) each row's rsqrt factor into r_ptr [M] (float32: the
    router remakes the rows from it, kernels/router.py ``norm``).
    Shared by ``_rms_norm_kernel`` and the fused epilogue of fp8_gemv.py, so both compute the same
    bits from the same rows (the sum of squares' order is the layout's: same tile and warps)."""
    if HAS_DELTA:
        # torch: x + delta.to(x.dtype), an fp32 sum rounded once to x's dtype
        x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + rows[:, None] * stride_xo + cols[None, :], x, mask=mask)
    t = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(t * t, axis=1) / H + eps)
    if STORE_R:
        tl.store(r_ptr + rows, r, mask=rows < M)
    y = ((t * r[:, None]) * w[None, :]).to(y_ptr.dtype.element_ty)
    if STORE_Y:
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    if QUANT:
        # act_quant of the rounded output, group by group (masked columns are 0: no effect on amax)
        NG: tl.constexpr = BLOCK_H // GROUP
        yg = tl.reshape(y.to(tl.float32), (BLOCK_M, NG, GROUP))
        scale = group_scale(tl.max(tl.abs(yg), axis=2), FP8_MAX_C, EPS)  # [BLOCK_M, NG]
        q = tl.reshape(e4m3_saturated(yg / scale[:, :, None], FP8_MAX_C), (BLOCK_M, BLOCK_H))
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        g = tl.arange(0, NG)
        tl.store(s_ptr + rows[:, None] * stride_s + g[None, :], scale,
                 mask=(rows[:, None] < M) & (g[None, :] < tl.cdiv(H, GROUP)))


@triton.jit
def _rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, q_ptr, s_ptr, cw_ptr,
    M, H, stride_x, stride_d, stride_xo, stride_y, stride_q, stride_s, eps,
    HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr = False, GROUP: tl.constexpr = 128, FP8_MAX_C: tl.constexpr = 448.0, EPS: tl.constexpr = 1e-10,
    TOP_K: tl.constexpr = 0, PDL: tl.constexpr = False, STORE_Y: tl.constexpr = True, r_ptr=None,
    STORE_R: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)  # the norm's weight: before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    d = x  # no delta: unused
    if HAS_DELTA:
        if TOP_K > 0:
            # delta = the MoE's weighted combine of TOP_K per-slot rows (kernels/moe.py's
            # _moe_combine_kernel: fp32 products and sum in slot order, one rounding to bf16)
            acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                wj = tl.load(cw_ptr + rows * TOP_K + j, mask=rows < M, other=0.0).to(tl.float32)
                yj = tl.load(d_ptr + (rows[:, None] * TOP_K + j) * stride_d + cols[None, :], mask=mask, other=0.0)
                acc += wj[:, None] * yj.to(tl.float32)
            d = acc.to(tl.bfloat16)
        else:
            d = tl.load(d_ptr + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
    add_rms_norm_rows(x, d, w, rows, cols, mask, M, H, eps, xo_ptr, y_ptr, q_ptr, s_ptr, stride_xo, stride_y, stride_q,
                      stride_s, HAS_DELTA, QUANT, BLOCK_M, BLOCK_H, GROUP, FP8_MAX_C, EPS, STORE_Y, r_ptr, STORE_R)


def norm_tile(h: int, quant: bool, delta: bool = True, stream_rows: int = 2) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_M, num_warps) of a norm over rows of ``h``: the whole row in one tile, ~2048
    elements per program for small H. A kernel calling ``add_rms_norm_rows`` on the same tile with
    the same warps gets the same layout, hence the same sum-of-squares order and the same bits.
    Without a delta (the stream alone, e.g. the post-attention norm after o_proj added the residual)
    and rows of 4096 columns or more: two rows a program, the same warps (one row moves too few bytes
    to keep the loads in flight: 122.2-122.8 against 145.9 us at the 20b's 32768 tokens, H100,
    ``benchmarks/norm_sweep.py``, forty-fourth session; the same bits there, each row reduced in the same
    order, and on the GPU in tests/kernels/test_norm.py). With a delta (the MoE's combine: ~1.2 GB, at
    3.04 TB/s either way) one row. ``stream_rows``: the rows a program without a delta there
    (``KernelConfig.norm_stream_rows``; 1 as before the forty-fourth session)."""
    block_h = max(next_pow2(h), ACT_GROUP if quant else 1)
    block_m = max(1, min(16, 2048 // block_h))  # ~2048 elements per program for small H
    if not delta and block_h >= 4096:
        block_m = stream_rows
    return block_h, block_m, 8 if block_h >= 4096 else 4


def norm_buffers(x: torch.Tensor, rows: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Empty (new x, normed rows or None, y_fp8, scale) for ``rms_norm_quant`` of x's rows [T, H], its ``out``
    form: each row-sliceable (a row's values at one row index of each)."""
    m, h = x.shape
    return (torch.empty_like(x), torch.empty_like(x) if rows else None,
            torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((m, cdiv(h, ACT_GROUP)), dtype=torch.float32, device=x.device))


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, quant: bool = False,
            combine: torch.Tensor | None = None, pdl: bool = False, rows: bool = True, out: tuple | None = None,
            rstd: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None):
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}"
    m, h = x.shape
    assert weight.shape == (h,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} does not fit H={h}"
    assert rows or quant, "the normed rows may be left out only beside their FP8 quantization"
    if out is not None:  # ``norm_buffers``' form, or row slices of it: written in place
        assert quant and delta is not None, "out= is for rms_norm_quant with a delta"
        xo, y, q, s = out
        want = [(xo, x.dtype, (m, h)), (q, FP8_DTYPE, (m, h)), (s, torch.float32, (m, cdiv(h, ACT_GROUP)))]
        for t, dtype, shape in want + ([(y, x.dtype, (m, h))] if rows else []):
            assert t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.stride(-1) == 1, (
                f"out {None if t is None else (tuple(t.shape), t.dtype)} does not fit {shape} {dtype}")
        y = y if rows else x
    else:
        y = torch.empty_like(x) if rows else x  # (rows=False: y_ptr unread and unwritten)
        xo = torch.empty_like(x) if delta is not None else x
    top_k = 0
    if combine is not None:  # delta: per-slot rows [T, k, H] / [T * k, H], combined with these weights
        assert delta is not None and combine.dim() == 2 and combine.shape[0] == m, \
            f"combine weights {tuple(combine.shape)} for {m} rows"
        top_k = combine.shape[1]
        assert delta.shape[-1] == h and delta.numel() == m * top_k * h, \
            f"per-slot rows {tuple(delta.shape)} do not fit [{m}, {top_k}, {h}]"
        delta = delta.reshape(m * top_k, h)
        combine = combine.contiguous()
    elif delta is not None:
        assert delta.shape == x.shape, f"delta {tuple(delta.shape)} does not fit x {tuple(x.shape)}"
    if delta is not None:
        assert delta.stride(-1) == 1, f"delta {tuple(delta.shape)} needs a contiguous last dim"
    if rstd is not None:
        assert rstd.shape == (m,) and rstd.dtype == torch.float32 and rstd.is_contiguous(), (
            f"rstd {tuple(rstd.shape)} {rstd.dtype}: a contiguous float32 [{m}]")
    if out is None:
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if quant else y
        s = torch.empty((m, cdiv(h, ACT_GROUP)), dtype=torch.float32, device=x.device) if quant else y
    if m == 0:
        return xo, y if rows else None, (q, s) if quant else None
    block_h, block_m, num_warps = tile or norm_tile(h, quant, delta is not None)
    d = delta if delta is not None else x
    _rms_norm_kernel[(cdiv(m, block_m),)](
        x, d, weight, xo, y, q, s, combine if combine is not None else weight, m, h,
        x.stride(0), d.stride(0), xo.stride(0), y.stride(0), q.stride(0), s.stride(0),
        float(eps), HAS_DELTA=delta is not None, BLOCK_M=block_m, BLOCK_H=block_h,
        QUANT=quant, GROUP=ACT_GROUP, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, TOP_K=top_k,
        PDL=pdl, num_warps=num_warps, **({} if rows else {"STORE_Y": False}),
        **({} if rstd is None else {"r_ptr": rstd, "STORE_R": True}), **launch_kwargs(pdl),
    )
    return xo, y if rows else None, (q, s) if quant else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (bf16), weight float32 [H] -> normed [T, H] in x's dtype."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (x + delta.to(x.dtype), rms_norm of that), both [T, H] in x's dtype.
    delta may be bf16 or float32 (an all-reduced partial sum, rounded here once)."""
    return _launch(x, delta, weight, eps)[:2]


def rms_norm_quant(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    combine: torch.Tensor | None = None, pdl: bool = False, rows: bool = True, out: tuple | None = None,
    rstd: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """``add_rms_norm`` (or ``rms_norm`` when delta is None: the returned x is x itself) that also
    returns (y_fp8 [T, H], scale float32 [T, ceil(H/128)]) = act_quant(y), in the same pass.
    ``combine`` (weights [T, k]): delta is the MoE's per-slot rows [T, k, H] (or [T * k, H]) and the
    residual delta is their weighted combine, ``moe.moe_combine(delta, combine)`` bit for bit,
    computed in the same pass (the [T, H] combine is never written). ``pdl``: launch with
    programmatic dependent launch (kernels/pdl.py; the norm's weight is read before the wait). ``rows=False``:
    the normed bf16 rows are not written (returned as None), for a caller that reads only their quantization
    (the next layer's q / k / v GEMM): one [T, H] write fewer. ``out`` (with a delta): ``norm_buffers``' four
    (or row slices of them) to write instead of new tensors, returned the same way. ``rstd`` (float32 [T]):
    each row's rsqrt factor written there (the router remakes the rows from the new x and it: kernels/router.py
    ``norm``). ``tile``: (BLOCK_H, BLOCK_M, num_warps) instead of ``norm_tile``'s (measurement: another tile may
    sum the squares in another order, and the router remakes the rows on ``norm_tile``'s)."""
    return _launch(x, delta, weight, eps, quant=True, combine=combine, pdl=pdl, rows=rows, out=out, rstd=rstd,
                   tile=tile)

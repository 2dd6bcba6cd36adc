"""The optional DeepGEMM backend of the dense and grouped FP8 GEMMs (``KernelConfig.gemm = "deep_gemm"``).

DeepGEMM (deepseek-ai/DeepGEMM; ../shared/peers/ packs 03d0be3 with ``deepgemm_setup.sh``) is used
when importable, never required: ``available()`` imports it lazily once and never raises;
``require()`` raises one GptOssFp8Error line saying how to get it. Its two calls, as documented:
``gemm_fp8_fp8_bf16_nt((x [M, K], xs [M, K/128]), (w [N, K], ws [N/128, K/128]), out bf16 [M, N])``
and ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((x [M, K], xs), (w [E, N, K], ws [E, N/128, K/128]),
out, m_indices int32 [M])`` (rows grouped by expert, each expert's segment starting on a 128-row
boundary, -1 = padding row whose output is unspecified). Requirements we meet here: K % 128 == 0
(K = 2880 is zero-padded to 2944; the weight scale grid is unchanged, ceil(2880/128) = 23 blocks);
activation scales column-major with 16-byte aligned columns (``act_quant.scale_layout``; DeepGEMM
otherwise transposes them with slow torch ops on every call); N % 8 == 0 (dense calls with other N
run our ``fp8_gemm``; no gpt-oss shape has one). No bias, no SwiGLU, bf16 output only: the rest
runs in our neighbouring kernels.

Weights are prepared once per weight tensor and cached here, keyed weakly by the model's tensor
(dropped with it; rebuilt when any source tensor is replaced or changed in place, as
TritonOps._fused_weights): the K-padded copy (the source itself when K % 128 == 0 and contiguous),
contiguous scales, and for q/k/v the padded concatenation. A padded copy is N * round_up(K, 128)
bytes per FP8 weight with K % 128 != 0: for the 20b nearly all weights (experts 24 x 32 x 8640 x
2944 = 19.5 GB, q/k/v 24 x 5120 x 2944 = 0.36 GB; o_proj, K = 4096, none). Beside the unpadded
weights that would be a second copy (the 20b ~41 GB; the 120b's 117 GB of padded experts would
not fit one H200), so ``adopt_padded(model)`` makes the padded copies the model's own weights
(each becomes the [..., :K] view of its copy; +2.2% bytes, the padding): ``verify-logits --gemm
deep_gemm`` (before its kernels mode) and ``bench prefill --gemm deep_gemm`` call it. Only the
q/k/v concatenation stays a copy (0.36 GB on the 20b), as on our own path. ``clear_cache()`` drops
the cache.

Dense (``linear`` / ``linears``): x quantized by ``act_quant(pad_k, col_major_scale)`` straight into
the K-padded buffer and DeepGEMM's scale layout; when the norm's pass already quantized x (``xq``,
unpadded, row-major scales) its bytes are copied into that layout instead (T*(K + K_pad) + 8*T*K/128
bytes). The bias is added in place after the GEMM (bf16 + bf16 in fp32, one rounding; 4*T*N bytes
more traffic: 168 MB, ~50 us, for the qkv at 8192 rows; the peers' README measured ~110 us):
fusing it into rope / the residual add would change the model's op interface. float32 out (a
sharded o_proj's partial sums): the bf16 product widened, + bias in fp32 (one bf16 rounding per
rank the ``ours`` path does not have). A new row count M may compile a new DeepGEMM kernel at its
first call (its tiles, stages and multicast are chosen from M and are template arguments; nvcc,
seconds; cached on disk after).

Grouped (``expert_slots``, the contract of ``moe.moe_expert_slots``): ``moe_align`` with 128-row
alignment; ``_gather_rows_kernel`` copies each sorted row's token quantization into a K-padded A
[R, round_up(H, 128)] with column-major scales and writes m_indices (-1 for padding rows); gate_up
on DeepGEMM -> bf16 [R, 2I]; ``swiglu_quant`` (bias + clamped SwiGLU + 1x128 FP8 of the
intermediate, K-padded); down on DeepGEMM -> bf16 [R, H]; ``_scatter_bias_kernel`` writes each
valid row to y[slot] with the down bias added in fp32 (one rounding to y's dtype). Slots routed to
other ranks are zeroed (``moe.zero_foreign_rows``). Against our fused path this moves 2*R*2I*2 +
2*R*H*2 more bytes (the two bf16 GEMM outputs written and read back: ~1.1 GB, ~0.3 ms at 8192
tokens x top-4) and rounds both GEMM products to bf16 before their bias (the ``ours`` path adds it
to the fp32 accumulator). ``partial`` (intermediate split over ranks): y = the bf16 down product
widened to float32, no bias.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels.act_quant import act_quant, scale_layout
from gptoss_fp8.kernels.moe import zero_foreign_rows
from gptoss_fp8.kernels.moe_align import moe_align
from gptoss_fp8.kernels.swiglu_quant import swiglu_quant
from gptoss_fp8.quant.fp8 import BLOCK, FP8_DTYPE, cdiv, next_pow2

ALIGN_M = 128  # DeepGEMM's get_m_alignment_for_contiguous_layout()
DENSE_API = "gemm_fp8_fp8_bf16_nt"
GROUPED_API = "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"
HOW_TO_GET = ("on a Hopper machine with nvcc: source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz "
              "(DeepGEMM 03d0be3 from ../shared/peers/, compiled by nvcc at first use; BENCHMARKS.md "
              "'How to run the peers'), or install deepseek-ai/DeepGEMM; or use --gemm ours")


# ------------------------------------------------------------------------------------------------
# Availability


@functools.cache
def _load():
    """(the deep_gemm module, "") or (None, why not): imported once."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - any failure to import (missing, broken CUDA setup) means "not available"
        return None, f"{type(e).__name__}: {e}"
    missing = [n for n in (DENSE_API, GROUPED_API) if not hasattr(deep_gemm, n)]
    if missing:
        return None, f"the deep_gemm at {getattr(deep_gemm, '__file__', '?')} has no {', '.join(missing)}"
    return deep_gemm, ""


def available() -> bool:
    """Whether ``import deep_gemm`` works and has the two calls used here (cached; never raises)."""
    return _load()[0] is not None


def require():
    """The deep_gemm module, or GptOssFp8Error (one line: why, and how to get it)."""
    mod, why = _load()
    if mod is None:
        raise GptOssFp8Error(f"gemm 'deep_gemm' (--gemm deep_gemm / KernelConfig.gemm) needs the deep_gemm "
                             f"package, which is not importable ({why}); {HOW_TO_GET}")
    return mod


# ------------------------------------------------------------------------------------------------
# Weights, prepared once


_DENSE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (stamp, (w_padded, scale))
_FUSED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # first q/k/v weight -> (stamp, (w, scale, bias))


def clear_cache() -> None:
    """Drop every prepared (K-padded) weight."""
    _DENSE.clear()
    _FUSED.clear()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return -1


def _cached(cache, key: torch.Tensor, parts, make):
    stamp = tuple((id(t), _version(t)) for t in parts if t is not None)
    hit = cache.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = make()
    cache[key] = (stamp, value)
    return value


def pad_k(w: torch.Tensor) -> torch.Tensor:
    """FP8 [..., K] -> contiguous [..., round_up(K, 128)] with zero columns after K (w itself when
    already aligned and contiguous; the padded tensor itself when w is its [..., :K] view, as
    ``adopt_padded`` leaves the model's weights)."""
    k = w.shape[-1]
    kp = cdiv(k, BLOCK) * BLOCK
    if kp == k and w.is_contiguous():
        return w
    base = w._base
    if (base is not None and base.is_contiguous() and base.shape == (*w.shape[:-1], kp)
            and base.dtype == w.dtype and w.data_ptr() == base.data_ptr() and w.stride() == base.stride()):
        return base
    out = torch.zeros(*w.shape[:-1], kp, dtype=torch.uint8, device=w.device)
    out[..., :k] = w.view(torch.uint8)
    return out.view(w.dtype)


def prepared_weight(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K-padded w, contiguous scale_inv) of an FP8 weight [N, K] or experts [E, N, K], cached."""
    assert w.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32, f"{w.dtype} weight, {scale_inv.dtype} scales"
    assert scale_inv.shape[-2:] == (cdiv(w.shape[-2], BLOCK), cdiv(w.shape[-1], BLOCK)), (
        f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(w.shape)}")
    return _cached(_DENSE, w, (w, scale_inv), lambda: (pad_k(w), scale_inv.contiguous()))


def adopt_padded(model) -> int:
    """Make the K-padded copies the model's own weights: every FP8 weight with K % 128 != 0 becomes
    the [..., :K] view of its padded copy (``pad_k`` then hands DeepGEMM the copy itself), so the
    unpadded tensor is freed and the backend holds no second copy (the 20b: ~20 GB less; the 120b
    fits). The views are strided, not contiguous: the torch backends read them as they are; our
    kernels would copy them per call (``.contiguous()``), so a model adopted here is for the
    deep_gemm backend and the spec. Returns the bytes of padding added. Call it once after
    loading, before the first GEMM (what ``verify-logits --gemm deep_gemm`` and ``bench prefill
    --gemm deep_gemm`` do). A tensor several modules hold (bench's repeated layers) gets one copy."""
    added, views = 0, {}
    for mod in model.modules():
        for name, t in list(mod.named_buffers(recurse=False)):
            if t is None or t.dtype != FP8_DTYPE or t.dim() < 2 or t.shape[-1] % BLOCK == 0:
                continue
            if id(t) not in views:
                padded = pad_k(t)
                if padded is t._base:  # adopted already
                    continue
                views[id(t)] = (t, padded[..., :t.shape[-1]])  # t kept: its id stays its own
                added += padded.numel() - t.numel()
            setattr(mod, name, views[id(t)][1])
    return added


def prepared_fused(projs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q/k/v (weight, scale_inv, bias) concatenated along N (every N a multiple of 128, biases all
    present or all None) and K-padded, cached by the first weight."""
    def make():
        w = pad_k(torch.cat([w for w, _, _ in projs]))
        s = torch.cat([s for _, s, _ in projs]).contiguous()
        b = None if projs[0][2] is None else torch.cat([b for _, _, b in projs]).contiguous()
        return w, s, b

    return _cached(_FUSED, projs[0][0], [t for p in projs for t in p], make)


# ------------------------------------------------------------------------------------------------
# Activations


def padded_quant(x: torch.Tensor, xq=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, K] -> (fp8 [T, round_up(K, 128)] zero-padded, scale [T, ceil(K/128)] in DeepGEMM's
    layout): quantized here, or ``xq`` (x's act_quant, e.g. the norm's) copied into that layout."""
    if xq is None:
        return act_quant(x, pad_k=True, col_major_scale=True)
    q, s = xq
    t, g = s.shape
    s2 = scale_layout(t, g, s.device)
    s2.copy_(s)
    return pad_k(q), s2


# ------------------------------------------------------------------------------------------------
# Dense


def dense_ok(w: torch.Tensor) -> bool:
    """Whether DeepGEMM's dense call takes this [N, K] weight (bf16 output rows of 16 bytes: N % 8 == 0)."""
    return w.shape[0] % 8 == 0


def _gemm(xa, xs, w, s) -> torch.Tensor:
    out = torch.empty((xa.shape[0], w.shape[0]), dtype=torch.bfloat16, device=xa.device)
    if xa.shape[0]:
        getattr(require(), DENSE_API)((xa, xs), (w, s), out)
    return out


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's bf16 output plus bias: in place in bf16 (fp32 add, one rounding), or widened to float32."""
    if out_dtype == torch.float32:
        y = y.float()
        return y if bias is None else y.add_(bias.float())
    assert out_dtype == torch.bfloat16, f"out_dtype {out_dtype}"
    return y if bias is None else y.add_(bias)


def linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype = torch.bfloat16, xq=None) -> torch.Tensor:
    """y = x @ W^T + b on DeepGEMM: x bf16 [T, K], W fp8 [N, K] with scale_inv [ceil(N/128),
    ceil(K/128)], bias [N] or None -> [T, N] in out_dtype (bf16 or float32; module docstring)."""
    xa, xs = padded_quant(x, xq)
    wp, sp = prepared_weight(w, scale_inv)
    return _with_bias(_gemm(xa, xs, wp, sp), bias, out_dtype)


def linears(x: torch.Tensor, projs, xq=None) -> list[torch.Tensor]:
    """Several bf16-out projections of one x (q, k, v): one quantization; one GEMM over the
    concatenated weights when every N is a multiple of 128 and the biases are alike, else one each."""
    xa, xs = padded_quant(x, xq)
    if all(w.shape[0] % BLOCK == 0 for w, _, _ in projs) and len({b is None for _, _, b in projs}) == 1:
        w, s, b = prepared_fused(projs)
        y = _with_bias(_gemm(xa, xs, w, s), b, torch.bfloat16)
        return list(y.split([w.shape[0] for w, _, _ in projs], dim=-1))
    return [_with_bias(_gemm(xa, xs, *prepared_weight(w, s)), b, torch.bfloat16) for w, s, b in projs]


# ------------------------------------------------------------------------------------------------
# Grouped (experts)


@triton.jit
def _gather_rows_kernel(
    xq_ptr, xs_ptr, slots_ptr, block_expert_ptr, a_ptr, as_ptr, midx_ptr,
    M, K, K_OUT, num_slots, num_experts,
    stride_xm, stride_xsm, stride_xsg, stride_am, stride_asm, stride_asg,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ALIGN: tl.constexpr,
):
    """Sorted row r <- the FP8 bytes and scale of token slots[r] // TOP_K, K-padded with zeros;
    m_indices[r] = the row tile's expert, -1 for padding rows (whose A bytes are left unwritten)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    slots = tl.load(slots_ptr + offs_m, mask=m_ok, other=num_slots)
    valid = slots < num_slots
    if tl.program_id(1) == 0:
        e = tl.load(block_expert_ptr + offs_m // ALIGN, mask=m_ok, other=num_experts)
        tl.store(midx_ptr + offs_m, tl.where(valid & (e < num_experts), e, -1), mask=m_ok)
    src = (tl.where(valid, slots, 0) // TOP_K).to(tl.int64)
    rows = offs_m.to(tl.int64)
    offs_k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    q = tl.load(xq_ptr + src[:, None] * stride_xm + offs_k[None, :], mask=valid[:, None] & (offs_k < K)[None, :], other=0)
    tl.store(a_ptr + rows[:, None] * stride_am + offs_k[None, :], q, mask=valid[:, None] & (offs_k < K_OUT)[None, :])
    s = tl.load(xs_ptr + src * stride_xsm + tl.program_id(1) * stride_xsg, mask=valid, other=0.0)
    tl.store(as_ptr + rows * stride_asm + tl.program_id(1) * stride_asg, s, mask=valid)


def gather_rows(x_fp8: torch.Tensor, x_scale: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                top_k: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM's grouped A operand from moe_align's order: (fp8 [R, round_up(H, 128)], scale [R,
    ceil(H/128)] column-major TMA-aligned, m_indices int32 [R]); x_fp8 [T, H] / x_scale [T,
    ceil(H/128)] (act_quant of x, any row strides). Padding rows: m_indices -1, A bytes unwritten."""
    t, h = x_fp8.shape
    g = cdiv(h, BLOCK)
    assert x_scale.shape == (t, g), f"x scale {tuple(x_scale.shape)} does not fit x {tuple(x_fp8.shape)}"
    assert x_fp8.stride(-1) == 1, "x_fp8 needs a contiguous last dim"
    m = sorted_slots.shape[0]
    a = torch.empty((m, g * BLOCK), dtype=FP8_DTYPE, device=x_fp8.device)
    a_s = scale_layout(m, g, x_fp8.device)
    m_indices = torch.empty((m,), dtype=torch.int32, device=x_fp8.device)
    if m:
        block_m = 16
        _gather_rows_kernel[(cdiv(m, block_m), g)](
            x_fp8.view(torch.uint8), x_scale, sorted_slots, block_expert, a.view(torch.uint8), a_s, m_indices,
            m, h, g * BLOCK, t * top_k, num_experts,
            x_fp8.stride(0), x_scale.stride(0), x_scale.stride(1), a.stride(0), a_s.stride(0), a_s.stride(1),
            TOP_K=top_k, BLOCK_M=block_m, GROUP=BLOCK, ALIGN=ALIGN_M, num_warps=4,
        )
    return a, a_s, m_indices


@triton.jit
def _scatter_bias_kernel(
    h_ptr, bias_ptr, slots_ptr, midx_ptr, y_ptr,
    M, H, num_slots, stride_hm, stride_be, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """y[slots[r]] = h[r] (+ bias[m_indices[r]]) in fp32, one rounding, for every valid sorted row r."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    slots = tl.load(slots_ptr + offs_m, mask=m_ok, other=num_slots)
    e = tl.load(midx_ptr + offs_m, mask=m_ok, other=-1)
    valid = (slots < num_slots) & (e >= 0)
    if tl.max(valid.to(tl.int32), 0) > 0:
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = valid[:, None] & (offs_h < H)[None, :]
        v = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_h[None, :], mask=mask, other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:
            b = tl.load(bias_ptr + tl.where(valid, e, 0).to(tl.int64)[:, None] * stride_be + offs_h[None, :],
                        mask=mask, other=0.0)
            v += b.to(tl.float32)
        dst = tl.where(valid, slots, 0).to(tl.int64)
        tl.store(y_ptr + dst[:, None] * stride_ym + offs_h[None, :], v.to(y_ptr.dtype.element_ty), mask=mask)


def scatter_bias(h: torch.Tensor, bias: torch.Tensor | None, sorted_slots: torch.Tensor, m_indices: torch.Tensor,
                 y: torch.Tensor) -> None:
    """y[slot] <- h[r] + bias[m_indices[r]] (fp32 add, one rounding to y's dtype) for every sorted
    row r with a slot (< y rows) and m_indices >= 0; h bf16 [R, H], bias [E, H] or None, y [T*k, H]."""
    m, hd = h.shape
    assert y.shape[1] == hd and y.stride(-1) == 1 and h.stride(-1) == 1, f"h {tuple(h.shape)}, y {tuple(y.shape)}"
    if bias is not None:
        assert bias.shape[1] == hd and bias.stride(-1) == 1, f"bias {tuple(bias.shape)}"
    if m:
        block_h = min(512, next_pow2(hd))
        _scatter_bias_kernel[(cdiv(m, 16), cdiv(hd, block_h))](
            h, bias if bias is not None else h, sorted_slots, m_indices, y, m, hd, y.shape[0], h.stride(0),
            bias.stride(0) if bias is not None else 0, y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_H=block_h, num_warps=4,
        )


def expert_slots(
    x: torch.Tensor, topk_ids: torch.Tensor,
    w13: torch.Tensor, w13_scale_inv: torch.Tensor, b13: torch.Tensor,
    w2: torch.Tensor, w2_scale_inv: torch.Tensor, b2: torch.Tensor | None,
    expert_start: int = 0, swiglu_limit: float = 7.0, out_dtype: torch.dtype = torch.bfloat16,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-(token, slot) expert outputs [T*k, H] in out_dtype with the two grouped GEMMs on DeepGEMM
    (``moe.moe_expert_slots``' contract and argument layout; module docstring for what differs):
    row t*k + j = expert(x[t]) (+ b2 when given) for slot j routed to a local expert, zeros for
    slots routed to other ranks. x bf16 [T, H]; topk_ids int32 [T, k]; W13 fp8 [E, 2I, H] (+ scale,
    bias b13 [E, 2I]); W2 fp8 [E, H, I] (+ scale, bias b2 [E, H] or None)."""
    assert x.dim() == 2 and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], (
        f"x {tuple(x.shape)}, topk ids {tuple(topk_ids.shape)}")
    assert topk_ids.dtype == torch.int32, f"topk_ids must be int32, got {topk_ids.dtype}"
    t, h = x.shape
    e, two_i, _ = w13.shape
    assert w13.shape[2] == h and w2.shape == (e, h, two_i // 2), f"experts {tuple(w13.shape)}, {tuple(w2.shape)}"
    dg = require()
    k = topk_ids.shape[1]
    y = torch.empty((t * k, h), dtype=out_dtype, device=x.device)
    if t == 0:
        return y
    topk_ids = topk_ids.contiguous()
    zero_foreign_rows(topk_ids, y, expert_start, e)
    sorted_slots, block_expert = moe_align(topk_ids, expert_start, e, ALIGN_M)
    w13p, s13 = prepared_weight(w13, w13_scale_inv)
    w2p, s2 = prepared_weight(w2, w2_scale_inv)
    x_fp8, x_scale = x_quant if x_quant is not None else act_quant(x.contiguous())
    a, a_s, m_indices = gather_rows(x_fp8, x_scale, sorted_slots, block_expert, k, e)
    rows = a.shape[0]
    gate_up = torch.empty((rows, two_i), dtype=torch.bfloat16, device=x.device)
    getattr(dg, GROUPED_API)((a, a_s), (w13p, s13), gate_up, m_indices)
    act, act_s = swiglu_quant(gate_up, b13.contiguous(), m_indices, swiglu_limit)
    del gate_up, a
    down = torch.empty((rows, h), dtype=torch.bfloat16, device=x.device)
    getattr(dg, GROUPED_API)((act, act_s), (w2p, s2), down, m_indices)
    scatter_bias(down, None if b2 is None else b2.contiguous(), sorted_slots, m_indices, y)
    return y

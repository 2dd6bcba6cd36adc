"""MoE router in one kernel: logits = x @ Wr^T + br (bf16), top-k, softmax over the k selected (Triton).

gpt-oss's router (``gpt_oss/torch/model.py`` MLPBlock): ``g = gate(x)`` (a bf16 ``nn.Linear`` with
bias), ``topk(g, k, sorted=True)``, ``softmax(values)`` in bf16. Torch runs that as four kernels
(GEMM, top-k, softmax, an int64 -> int32 cast for the MoE); here one program takes BLOCK_T tokens
and all E experts: the fp32 product over H, the bias in fp32, one rounding to bf16 (the logits,
written for captures), then k rounds of (row max, lowest column holding it, mask it out) and the
softmax of the k values in fp32 with one rounding to bf16.

Numerics against ``gptoss_fp8.spec.route`` (torch on the same device):
* logits: fp32 sums in another order than cuBLAS / the CPU GEMM: within one bf16 ulp;
* ids: ties (equal bf16 logits) go to the lowest expert id; torch's top-k order among equal values
  is unspecified. Where two logits differ by one bf16 ulp, a one-ulp difference above can swap
  them; otherwise the same experts in the same order;
* weights: ``exp`` on the GPU is approximate: within one bf16 ulp of torch's softmax.

Layout: x bf16 [T, H] (contiguous last dim), weight bf16 [E, H] contiguous, all E experts in one
tile (BLOCK_E = next_pow2(E): meant for gpt-oss's 32 / 128); top_k <= E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gptoss_fp8.quant.fp8 import cdiv, next_pow2


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, ids_ptr, wts_ptr,
    T, H, E, stride_x, stride_w, stride_l,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < H) | EVEN_K  # no K mask when BLOCK_K divides H: Triton then pipelines the loads
        a = tl.load(x_ptr + rows64[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + offs_k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 arithmetic is not the GPU's: products in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    logits = acc.to(logits_ptr.dtype.element_ty)  # one rounding, as a bf16 linear with bias
    tl.store(logits_ptr + rows64[:, None] * stride_l + cols[None, :], logits, mask=row_ok[:, None] & col_ok[None, :])

    v = tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf"))
    slot = tl.arange(0, KP)
    vals = tl.full([BLOCK_T, KP], float("-inf"), dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(v, 1)
        pick = tl.min(tl.where(v == m[:, None], cols[None, :], BLOCK_E), 1)  # lowest id among ties
        pick = tl.minimum(pick, E - 1)  # NaN logits match nothing: keep the id in range (memory-safe)
        vals = tl.where(slot[None, :] == j, m[:, None], vals)
        ids = tl.where(slot[None, :] == j, pick[:, None], ids)
        v = tl.where(cols[None, :] == pick[:, None], float("-inf"), v)
    # softmax over the k selected values (sorted: the first is the max); padded slots weigh 0
    p = tl.exp(vals - tl.max(vals, 1)[:, None])
    w = p / tl.sum(p, 1)[:, None]
    out = rows64[:, None] * TOP_K + slot[None, :]
    ok = row_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(ids_ptr + out, ids, mask=ok)
    tl.store(wts_ptr + out, w.to(wts_ptr.dtype.element_ty), mask=ok)


def router_config(num_tokens: int, num_experts: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_T, num_warps, num_stages): tokens per program (all experts in one tile). From the
    H200 (CUDA-graph device time, 2880 hidden, top-4): 32 experts (64, 4, 5) 12.8 us at 8192 tokens
    against 16.4 for (32, 4, 4) and 20.1 for (64, 4, 3); 128 experts (64, 4, 5) 20.1 us at 8192,
    (128, 8, 3) 62 us at 32768 against 77-80 for the 64-token tiles."""
    if not on_gpu:
        return 16, 4, 1
    if num_experts > 64 and num_tokens > 16384:
        return 128, 8, 3
    return 64, 4, 5


def router(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [T, H], weight bf16 [E, H], bias bf16 [E] (or None), top_k <= E ->
    (logits bf16 [T, E], ids int32 [T, k] sorted by logit, weights bf16 [T, k] = softmax over them).
    ``config``: (BLOCK_T, num_warps, num_stages) instead of ``router_config``'s."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}"
    t, h = x.shape
    assert weight.dim() == 2 and weight.shape[1] == h and weight.is_contiguous(), f"router weight {tuple(weight.shape)} for H={h}"
    e = weight.shape[0]
    assert 1 <= top_k <= e, f"top_k {top_k} must be in 1..{e} experts"
    assert x.dtype == weight.dtype == torch.bfloat16, f"x {x.dtype}, weight {weight.dtype}: want bfloat16"
    if bias is not None:
        assert bias.shape == (e,) and bias.is_contiguous(), f"router bias {tuple(bias.shape)} for {e} experts"
    logits = torch.empty((t, e), dtype=x.dtype, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    wts = torch.empty((t, top_k), dtype=x.dtype, device=x.device)
    if t == 0:
        return logits, ids, wts
    on_gpu = x.device.type == "cuda"
    block_t, warps, stages = config or router_config(t, e, on_gpu)
    block_k = 64
    _router_kernel[(cdiv(t, block_t),)](
        x, weight, bias if bias is not None else weight, logits, ids, wts,
        t, h, e, x.stride(0), weight.stride(0), logits.stride(0),
        HAS_BIAS=bias is not None, TOP_K=top_k, KP=max(2, next_pow2(top_k)),
        BLOCK_T=block_t, BLOCK_E=max(16, next_pow2(e)), BLOCK_K=block_k, UPCAST=not on_gpu,
        EVEN_K=h % block_k == 0, num_warps=warps, num_stages=stages,
    )
    return logits, ids, wts

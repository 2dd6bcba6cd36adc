"""The small ops interface the gpt-oss forward pass is written against, and its CPU backends.

* ``reference`` (``weights`` mode): FP8 weights dequantized to bf16 (exact for an exact
  conversion), activations and op order as in OpenAI's ``gpt_oss/torch/model.py``. It isolates
  the conversion: on an exactly converted checkpoint it agrees with OpenAI's reference to bf16
  rounding.
* ``w8a8-cpu`` (``w8a8`` mode): what serving and the GPU kernels compute for every FP8 weight:
  activations quantized per token in 1x128 groups (quant/fp8.quantize_act), FP8 x FP8 products
  accumulated in fp32 with both block scales, bias added in fp32, one cast to bf16
  (quant/fp8.block_gemm_reference). This is the executable specification GPU kernels are tested
  against. bf16 weights (router, embeddings, lm_head, attention kept bf16) stay bf16 GEMMs.

Attention, RMSNorm and RoPE are the same in both backends (bf16 / fp32 exactly as the reference);
a GPU backend overrides what it accelerates and must agree with ``w8a8-cpu`` to fp32-accumulation
noise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptoss_fp8.parallel import Parallel
from gptoss_fp8.quant.fp8 import (
    FP8_DTYPE,
    block_gemm_reference,
    dequantize_weight_blocks,
    quantize_act,
)

MODES = {"weights": "reference", "w8a8": "w8a8-cpu"}


def swiglu(x: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """Clamped SwiGLU on interleaved rows (2j = gate j, 2j+1 = linear j), +1 on the linear half."""
    x_glu, x_lin = x[..., ::2], x[..., 1::2]
    x_glu = x_glu.clamp(min=None, max=limit)
    x_lin = x_lin.clamp(min=-limit, max=limit)
    return x_glu * torch.sigmoid(alpha * x_glu) * (x_lin + 1)


class ReferenceOps:
    """bf16 activations, FP8 weights dequantized (the ``weights`` mode)."""

    name = "reference"
    # dtype of the expert gate_up output and the SwiGLU: bf16 as in OpenAI's reference.
    intermediate_dtype = torch.bfloat16

    # --- GEMMs -------------------------------------------------------------------------------
    def weight(self, w: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
        """A weight as bf16 [N, K] (dequantized when FP8)."""
        if w.dtype == FP8_DTYPE:
            assert scale_inv is not None, f"fp8 weight {tuple(w.shape)} without scale_inv"
            return dequantize_weight_blocks(w, scale_inv, torch.bfloat16)
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None,
               bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """y = x @ W^T + b: x bf16 [T, K], W [N, K] (bf16, or fp8 with block scales), b [N] -> [T, N].
        bf16 out: bias fused as in torch.nn.Linear (the reference's projections). float32 out (a
        partial sum of a sharded layer, rounded once after the all-reduce): fp32 product + bias."""
        wd = self.weight(w, scale_inv)
        if out_dtype == torch.bfloat16:
            return F.linear(x, wd, bias)
        return F.linear(x.float(), wd.float(), None if bias is None else bias.float()).to(out_dtype)

    def linears(self, x: torch.Tensor, projs: list[tuple]) -> list[torch.Tensor]:
        """Several projections of the same input (q, k, v): ``[linear(x, w, s, b) for (w, s, b) in
        projs]``. A backend may quantize x once and run them as one GEMM; the results are the same."""
        return [self.linear(x, w, s, b) for w, s, b in projs]

    def expert_linear(self, x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None,
                      bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """One expert's projection. The reference rounds the product to bf16, then adds the bias
        in bf16 (``einsum(...) + bias``); so do we (float32 partials: one fp32 sum)."""
        if out_dtype != torch.bfloat16:
            return self.linear(x, w, scale_inv, bias, out_dtype)
        y = F.linear(x, self.weight(w, scale_inv))
        return y if bias is None else y + bias

    # --- the rest: identical in every CPU backend ----------------------------------------------
    def route(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE router: (logits bf16 [T, E] = the bf16 linear with bias, expert ids [T, k] of the
        top-k logits sorted descending, weights bf16 [T, k] = softmax over those k logits in bf16)."""
        from gptoss_fp8.kernels.router import select_experts

        g = self.linear(x, weight, None, bias)
        return g, *select_experts(g, top_k)

    def expert_ffn(self, x: torch.Tensor, idx: torch.Tensor, experts: dict[str, torch.Tensor | None],
                   first_expert: int, limit: float, partial: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Routed expert FFN on this rank's experts (and intermediate part).

        x bf16 [T, H]; idx int64 [T, k] global expert ids; experts: gate_up_proj [E_l, 2I_l, H]
        (+ _scale_inv, _bias [E_l, 2I_l]), down_proj [E_l, H, I_l] (+ _scale_inv, _bias [E_l, H] or
        None when another rank owns it). Returns (y, b), float32 [T, k, H] each, zeros for experts
        held elsewhere. Whole experts (``partial`` False): y = the bf16 per-expert outputs, bias
        included, b None. Intermediate dim split over ranks (``partial``): y = unrounded fp32
        partial products of the down projection, b = the down bias where this rank owns it; the
        model sums both over ranks, rounds the sum to bf16 and then adds the bias, as the reference.
        """
        t, k = idx.shape
        out = torch.zeros(t, k, x.shape[-1], dtype=torch.float32, device=x.device)
        bias_out = torch.zeros_like(out) if partial else None
        n_local = experts["gate_up_proj"].shape[0]
        local = idx - first_expert
        for e in torch.unique(local[(local >= 0) & (local < n_local)]).tolist():
            tok, slot = torch.nonzero(local == e, as_tuple=True)
            h = self.expert_linear(x[tok], experts["gate_up_proj"][e], _at(experts["gate_up_proj_scale_inv"], e),
                                   _at(experts["gate_up_proj_bias"], e), self.intermediate_dtype)
            h = swiglu(h, limit)
            b = _at(experts["down_proj_bias"], e)
            if partial:
                out[tok, slot] = self.expert_linear(h, experts["down_proj"][e], _at(experts["down_proj_scale_inv"], e),
                                                    None, torch.float32)
                if b is not None:
                    bias_out[tok, slot] = b.float()
            else:
                out[tok, slot] = self.expert_linear(h, experts["down_proj"][e], _at(experts["down_proj_scale_inv"], e),
                                                    b).float()
        return out, bias_out

    def all_reduce(self, t: torch.Tensor, par: Parallel) -> torch.Tensor:
        """Sum a partial result over the ranks of ``par`` (fp32 on the wire; identity on one rank)."""
        return par.all_reduce(t)

    def add_bias_after_sum(self, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Combine all-reduced fp32 partial products y and bias b of a split expert down projection.
        The reference rounds the product, then adds the bias in bf16 (its mlp2 bias comes after
        the all-reduce)."""
        return y.to(torch.bfloat16) + b.to(torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """fp32 RMSNorm, cast back to x's dtype; weight float32 [H]."""
        from gptoss_fp8.kernels.norm import rms_norm_reference

        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add of the bf16 stream (x + delta.to(x.dtype)), then ``rms_norm`` of the sum:
        (new x, normed)."""
        from gptoss_fp8.kernels.norm import add_rms_norm_reference

        return add_rms_norm_reference(x, delta, weight, eps)

    def moe_combine(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of per-slot expert outputs: y bf16 [T, k, H], weights bf16 [T, k] -> bf16
        [T, H] (the reference's einsum: fp32 accumulation, one rounding)."""
        return torch.einsum("bec,be->bc", y, weights)

    def moe_combine_add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(x, moe_combine(y, weights), ...)``: the MoE's residual add and the next
        norm. A backend may fuse the three; the values are the same."""
        return self.add_rms_norm(x, self.moe_combine(y, weights), norm_weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate halves of each head: x [T, heads, D]; cos/sin float32 [T, D/2], cast to x's dtype."""
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  sm_scale: float, window: int) -> torch.Tensor:
        """Causal attention with per-head sinks as an extra softmax column (then dropped).

        q [T, KV, M, D], k/v [T, KV, D], sinks [KV * M]; window > 0: key j visible to query i iff
        i - window < j <= i. Returns [T, KV * M * D] in q's dtype.
        """
        n, kvh, m, d = q.shape
        k = k[:, :, None, :].expand(-1, -1, m, -1)
        v = v[:, :, None, :].expand(-1, -1, m, -1)
        s = sinks.reshape(kvh, m, 1, 1).expand(-1, -1, n, -1)
        mask = torch.triu(q.new_full((n, n), -float("inf")), diagonal=1)
        if window > 0:
            mask += torch.tril(mask.new_full((n, n), -float("inf")), diagonal=-window)
        qk = torch.einsum("qhmd,khmd->hmqk", q, k)
        qk *= sm_scale
        qk += mask[None, None, :, :]
        qk = torch.cat([qk, s], dim=-1)
        w = torch.softmax(qk, dim=-1)[..., :-1]
        return torch.einsum("hmqk,khmd->qhmd", w, v).reshape(n, -1)


class W8A8CpuOps(ReferenceOps):
    """FP8 weights x FP8 activations (per-token 1x128 groups), fp32 accumulation: the ``w8a8`` mode."""

    name = "w8a8-cpu"
    # The fused MoE keeps the gate_up accumulator (+ bias) and the SwiGLU in fp32 and quantizes the
    # intermediate straight to FP8; rounding it to bf16 first would only add error, so the spec
    # does the same.
    intermediate_dtype = torch.float32

    def linear(self, x, w, scale_inv, bias, out_dtype=torch.bfloat16):
        if w.dtype != FP8_DTYPE:
            return super().linear(x, w, scale_inv, bias, out_dtype)
        assert scale_inv is not None, f"fp8 weight {tuple(w.shape)} without scale_inv"
        xq, xs = quantize_act(x)
        return block_gemm_reference(xq, xs, w, scale_inv, bias, out_dtype=out_dtype)

    def add_bias_after_sum(self, y, b):
        """The w8a8 spec adds the bias in fp32 and rounds once (as block_gemm_reference)."""
        return (y + b).to(torch.bfloat16)

    def expert_linear(self, x, w, scale_inv, bias, out_dtype=torch.bfloat16):
        if w.dtype != FP8_DTYPE:
            return super().expert_linear(x, w, scale_inv, bias, out_dtype)
        return self.linear(x, w, scale_inv, bias, out_dtype)


def _at(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if t is None else t[e]


def get_ops(name: str) -> ReferenceOps:
    """Backend by name: ``reference`` / ``weights``, ``w8a8-cpu`` / ``w8a8``, or ``triton``."""
    name = MODES.get(name, name)
    if name == "reference":
        return ReferenceOps()
    if name == "w8a8-cpu":
        return W8A8CpuOps()
    if name == "triton":  # the GPU kernels
        from gptoss_fp8.model.triton_ops import TritonOps

        return TritonOps()
    raise ValueError(f"unknown ops backend {name!r}")

"""The ``triton`` ops backend: the gpt-oss forward pass on our GPU kernels (design.md section 4).

``TritonOps`` subclasses the executable specification ``W8A8CpuOps`` and overrides what the
kernels accelerate; everything else (the embedding, bf16 GEMMs of the lm_head and of attention
kept bf16, the all-reduces) stays the parent's torch code, on the GPU.

* ``linear``: FP8 weights -> ``act_quant`` (1x128 per-token groups) + ``fp8_gemm`` with the bias
  fused in fp32 and one rounding (bf16, or float32 partial sums of a sharded o_proj). bf16
  weights: the parent (torch). ``linears`` (q, k, v of one input): one ``act_quant``, and one GEMM
  over the concatenated weights (cached, ~N*K bytes per layer) when each N is a multiple of 128:
  per output element the same products, scales and bias as three GEMMs.
* ``expert_ffn``: the grouped FP8 expert GEMMs of kernels/moe.py (gate_up + bias + clamped SwiGLU
  + FP8 quantization fused, then down + bias), stopped before ``moe.py``'s weighted combine because
  the model combines [T, k, H] per-slot outputs (``moe_combine``). Whole experts: each routed (token, slot)
  row is the bf16 expert output, bias included (returned as bf16: the contract's float32 values are
  bf16-rounded by definition, so the model's ``.to(bf16)`` is exact either way and we skip a
  4-byte copy of T*k*H). Intermediate split over ranks (``partial``): the fp32 down-projection
  products without bias (the kernel's bias is a zero tensor, so acc + 0 is stored exactly), and
  the owner rank's down bias per routed slot, as the parent.
* ``attention``: ``attention_prefill`` (sinks as an extra softmax column, causal or sliding
  window, GQA); fp32 online softmax, where the reference computes in bf16. ``attention_kind``
  "fp8" / "fp8-lin": the kernel's FP8 variant (``spec.attention_fp8``'s roundings, P coded as ``attention_p_code``)
  in the full-attention layers (``fp8_attention``: the sliding-window layers stay bf16). ``attention_chunk`` (a
  prompt chunk after cached keys): the same kernel with its ``q_offset``.
* ``rope``: ``rope_qk`` (fp32 arithmetic, one rounding; the reference rounds cos/sin to bf16 and
  computes in bf16). Off with ``TritonOps(rope_kernel=False)``.
* ``rms_norm`` / ``add_rms_norm``: kernels/norm.py, the residual add and the fp32 norm in one pass
  (within one bf16 ulp of the torch code: reduction order, approximate rsqrt). The same pass
  writes the normed rows' FP8 quantization (the bits ``act_quant`` would give), returned as
  ``Normed.quant``; the ``linear(s)`` and ``expert_ffn`` that read those rows (or a block of them,
  ``Normed.rows``) take it as ``xq`` instead of quantizing again.
* ``route``: kernels/router.py, the router's bf16 GEMM + bias, top-k and softmax in one kernel
  (fp32 sums in another order than torch's bf16 linear: logits within one bf16 ulp; equal logits
  go to the lowest expert id).
* ``moe_combine``: kernels/moe.py's weighted combine of per-slot outputs (fp32 sum, one rounding);
  ``moe_combine_add_rms_norm``: the same combine inside the next residual-add + norm pass (same bits).

Known differences from ``W8A8CpuOps`` (what the tolerances in tests/test_triton_ops.py cover):
fp32 summation order; GPU division (kernels/act_quant.py: ~6e-5 of FP8 activation values one e4m3
step off); the MoE gate_up output is kept in fp32 through the SwiGLU before its FP8 quantization,
where ``W8A8CpuOps.expert_ffn`` rounds it to bf16 and computes the SwiGLU in bf16 (so a few
percent of the intermediate's FP8 values differ by one e4m3 step); attention and rope in fp32
instead of bf16.

* ``attention_cached`` (decode): kernels/attention_decode.py's split-KV kernel on the cache as it
  lies (full layers by length, sliding layers' rings with ``ring=True``), the sink counted once;
  no host read, so the step can be captured as a CUDA graph (model/graph.py).
* ``config.attention_backend == "flashinfer"``: ``attention`` of a whole prompt in bf16 (head_dim
  64 / 128 / 256) on FlashInfer's sink prefill (kernels/flashinfer_attention.py); FP8 attention,
  ``attention_chunk`` after cached keys and decode stay on ours.
* ``config.gemm == "deep_gemm"``: ``linear`` / ``linears`` / ``expert_ffn`` run DeepGEMM's GEMMs
  (kernels/deepgemm.py: K-padded weights prepared once, biases, SwiGLU and FP8 quantization in our
  neighbouring kernels) instead of ours.

Tuning: one ``KernelConfig`` (kernels/config.py) held as ``self.config`` and passed to every
launch; the default is ``KernelConfig()`` with ``gluon`` off when ``GPTOSS_FP8_GLUON=0`` is in the
environment (read once, when the object is built).

Anything the kernels do not support (CPU tensors without the Triton interpreter, dtypes other
than bf16 activations, K not a multiple of 16, head_dim not a power of two in 16..256, missing
scales) falls back to the parent, op by op, and is counted: ``spec_fallbacks`` (op -> calls, every
op this backend has a kernel for, zeros included; ``linears`` only dispatches to ``linear`` and is
counted there; bf16 GEMMs are torch by design and not counted) and ``fallback_shapes`` (op -> the
shapes that caused them).
"""

from __future__ import annotations

import os

import torch
import triton
from torch.utils.weak import WeakIdKeyDictionary

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.ops import Normed, QuantQ, W8A8CpuOps
from gptoss_fp8.quant.fp8 import FP8_DTYPE

BF16, F32 = torch.bfloat16, torch.float32
# the ops this backend has kernels for (each counted in spec_fallbacks when handed to the spec)
KERNEL_OPS = ("add_rms_norm", "attention", "expert_ffn", "linear", "moe_combine", "moe_combine_add_rms_norm",
              "rms_norm", "rope", "route")


def interpreter_on() -> bool:
    """Whether Triton kernels run in the interpreter (CPU tensors), TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_config() -> KernelConfig:
    """``KernelConfig()``, with the Gluon kernels off where ``GPTOSS_FP8_GLUON=0`` is set."""
    return KernelConfig(gluon=os.environ.get("GPTOSS_FP8_GLUON", "1").strip() != "0")


def _kernel_device(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take tensors on t's device: CUDA, or CPU under the interpreter."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreter_on())


def _shapes(*ts) -> str:
    return " ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in ts if isinstance(t, torch.Tensor))


class TritonOps(W8A8CpuOps):
    """GPU kernels for FP8 linears, the expert FFN, attention and rope; the rest as ``W8A8CpuOps``."""

    name = "triton"
    keep_prepared = False  # the kernels read FP8 weights; a spec fallback dequantizes per call

    def __init__(self, rope_kernel: bool = True, config: KernelConfig | None = None):
        if not torch.cuda.is_available() and not interpreter_on():
            raise GptOssFp8Error(
                "the triton ops backend needs a CUDA GPU (none is visible), or TRITON_INTERPRET=1 set before "
                "gptoss_fp8's kernels are imported (Triton interpreter on CPU, slow); on CPU use the w8a8-cpu spec "
                "(verify-logits --mode w8a8)"
            )
        self.rope_kernel = rope_kernel
        self.config = config if config is not None else default_config()
        self.spec_fallbacks: dict[str, int] = dict.fromkeys(KERNEL_OPS, 0)
        self.fallback_shapes: dict[str, set[str]] = {op: set() for op in KERNEL_OPS}
        self._positions: dict[tuple, torch.Tensor] = {}
        self._fused = WeakIdKeyDictionary()  # fused q/k/v weights, keyed by the q weight tensor

    def _fallback(self, op: str, *tensors) -> None:
        """Count one call of ``op`` handed to the spec, and the shapes that caused it."""
        self.spec_fallbacks[op] += 1
        self.fallback_shapes[op].add(_shapes(*tensors))

    def _pdl(self, x) -> bool:
        """Whether kernels on x's rows launch with programmatic dependent launch (kernels/pdl.py:
        a CUDA device and at most ``config.pdl_max_rows`` token rows)."""
        from gptoss_fp8.kernels.pdl import pdl_launch

        return pdl_launch(self.config, x.numel() // max(x.shape[-1], 1), x.device)

    def _quant(self, x, xq):
        """x's activation quantization: the caller's ``xq`` (the norm's pass) or ``act_quant(x)``."""
        if xq is not None:
            return xq
        from gptoss_fp8.kernels.act_quant import act_quant

        return act_quant(x, pdl=self._pdl(x))

    # --- dense ---------------------------------------------------------------------------------
    @staticmethod
    def _fp8_weight_ok(w, scale_inv, out_dtype=BF16) -> bool:
        """Whether a weight (and output dtype) is one the FP8 GEMMs take: fp8 [N, K] with block scales, K % 16 == 0."""
        return (w.dtype == FP8_DTYPE and scale_inv is not None and w.dim() == 2 and w.shape[1] % 16 == 0
                and out_dtype in (BF16, F32))

    def needs_rows(self, projs):
        """False when every projection runs our FP8 GEMM on x's quantization (the FP8 checkpoint's q / k / v):
        the norm before them may leave its bf16 rows out (``rows=False``). DeepGEMM's path keeps them."""
        return self.config.gemm == "deep_gemm" or not all(self._fp8_weight_ok(w, s) for w, s, _ in projs)

    def linear(self, x, w, scale_inv, bias, out_dtype=BF16, *, xq=None):
        if x is None:  # a norm's quantization alone (``needs_rows`` False): our GEMM on it, below
            assert xq is not None and not self.needs_rows([(w, scale_inv, bias)]) and out_dtype in (BF16, F32), (
                "x = None needs xq and an FP8 weight")
        elif not self._fp8_weight_ok(w, scale_inv, out_dtype) or not _kernel_device(x) or x.dtype != BF16:
            # bf16 weights (router, lm_head, bf16 attention: torch by design) and shapes fp8_gemm rejects
            if w.dtype == FP8_DTYPE:
                self._fallback("linear", x, w)
            return super().linear(x, w, scale_inv, bias, out_dtype)
        if self.config.gemm == "deep_gemm":
            from gptoss_fp8.kernels import deepgemm

            if deepgemm.dense_ok(w):  # N % 8 == 0 (every gpt-oss shape); else our kernel below
                return deepgemm.linear(x, w, scale_inv, bias, out_dtype, xq=xq)
        from gptoss_fp8.kernels.fp8_gemm import fp8_gemm

        x_fp8, x_scale = self._quant(x, xq)
        return fp8_gemm(x_fp8, x_scale, w.contiguous(), scale_inv.contiguous(),
                        None if bias is None else bias.contiguous(), out_dtype=out_dtype, config=self.config)

    def linear_add(self, x, w, scale_inv, bias, residual, *, xq=None):
        """``fp8_gemm(residual=)``: the residual added in the GEMM's epilogue, where ``config.gemm_residual`` is on,
        ``linear`` is this class's own (a subclass's, e.g. tests/mutations.py's, runs as it is), our GEMM takes the
        FP8 weight and its launch for these rows adds the residual in the epilogue (``residual_in_epilogue``: not
        the skinny decode kernel); None otherwise."""
        from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, residual_in_epilogue

        m, (n, k) = residual.shape[0], w.shape
        if not (self.config.gemm_residual and type(self).linear is TritonOps.linear and self.config.gemm != "deep_gemm"
                and self._fp8_weight_ok(w, scale_inv) and residual.dtype == BF16 and residual.dim() == 2
                and residual.is_contiguous() and _kernel_device(residual) and residual.shape[1] == n
                and (x is not None and x.dtype == BF16 or x is None and xq is not None)
                and residual_in_epilogue(m, n, k, self.config, self.config.gluon_on(residual.device))):
            return None
        x_fp8, x_scale = self._quant(x, xq)
        return fp8_gemm(x_fp8, x_scale, w.contiguous(), scale_inv.contiguous(),
                        None if bias is None else bias.contiguous(), config=self.config, residual=residual)

    def linears(self, x, projs, *, xq=None):
        """One activation quantization for all; one GEMM over the weights concatenated along N
        when every one is FP8 with N a multiple of 128 (block scales then stack), else one GEMM each.
        x = None: a norm's quantization alone (``needs_rows`` False for these projections)."""
        one_gemm = len(projs) >= 2 and len({w.shape[1] for w, _, _ in projs}) == 1
        if x is None:
            assert xq is not None and not self.needs_rows(projs), "x = None needs xq and FP8 weights"
        if not one_gemm or (x is not None and (not all(self._fp8_weight_ok(w, s) for w, s, _ in projs)
                                               or not _kernel_device(x) or x.dtype != BF16)):
            return super().linears(x, projs, xq=xq)  # one ``linear`` each (counted there)
        if self.config.gemm == "deep_gemm":
            from gptoss_fp8.kernels import deepgemm

            if all(deepgemm.dense_ok(w) for w, _, _ in projs):
                return deepgemm.linears(x, projs, xq=xq)
        from gptoss_fp8.kernels.fp8_gemm import fp8_gemm

        x_fp8, x_scale = self._quant(x, xq)
        fused = self._fused_weights(projs)
        if fused is None:
            return [fp8_gemm(x_fp8, x_scale, w.contiguous(), s.contiguous(), None if b is None else b.contiguous(),
                             config=self.config) for w, s, b in projs]
        y = fp8_gemm(x_fp8, x_scale, *fused, config=self.config)
        return list(y.split([w.shape[0] for w, _, _ in projs], dim=-1))

    def linears_q8(self, x, projs, rope, window, *, xq=None):
        """``fp8_gemm.fp8_gemm_q8``: Q rotated and quantized for the FP8 attention by the q / k / v GEMM's epilogue
        (``config.gemm_q_quant``; the Gluon 128 x 256 tile, else the GEMM then ``attn_quant.quantize_qk``), where
        the option is on, the layer's prefill attention is FP8 (a full layer, ``--attention fp8``), this class's own
        linears, rope and attention run (a subclass's, e.g. tests/mutations.py's, runs as it is), the weights fuse
        into one FP8 GEMM on our kernels and Q's heads are the attention's (head_dim 64, whole heads); None
        otherwise."""
        from gptoss_fp8.kernels.fp8_gemm import fp8_gemm_q8

        (wq, _, _), d = projs[0], rope[0].shape[-1] * 2
        if not (self.config.gemm_q_quant and self.fp8_attention(window) and self.config.gemm != "deep_gemm"
                and type(self).linears is TritonOps.linears and type(self).attention_out is TritonOps.attention_out
                and type(self).attention is TritonOps.attention and self._fused_rope(window, 1) and len(projs) == 3
                and d == 64 and wq.shape[0] % d == 0
                and (x is not None and x.dtype == BF16 and _kernel_device(x) or x is None and xq is not None)
                and all(self._fp8_weight_ok(w, s) for w, s, _ in projs)):
            return None
        fused = self._fused_weights(projs)
        if fused is None:
            return None
        x_fp8, x_scale = self._quant(x, xq)
        rope = tuple(t.float().contiguous() for t in rope)
        q8, qs, rest = fp8_gemm_q8(x_fp8, x_scale, *fused, wq.shape[0], rope, config=self.config, head_dim=d)
        return [QuantQ(q8, qs), *rest.split([w.shape[0] for w, _, _ in projs[1:]], dim=-1)]

    def _fused_weights(self, projs):
        """(weight, scale_inv, bias) concatenated along N, cached per first weight tensor (dropped
        with it; rebuilt if any weight is replaced or modified in place); None when N % 128 != 0
        somewhere or biases are mixed."""
        if any(w.shape[0] % 128 for w, _, _ in projs) or len({b is None for _, _, b in projs}) != 1:
            return None
        key = projs[0][0]
        stamp = tuple((id(t), _version(t)) for p in projs for t in p if t is not None)
        hit = self._fused.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        w = torch.cat([w for w, _, _ in projs]).contiguous()
        s = torch.cat([s for _, s, _ in projs]).contiguous()
        b = None if projs[0][2] is None else torch.cat([b for _, _, b in projs]).contiguous()
        self._fused[key] = (stamp, (w, s, b))
        return w, s, b

    # --- experts ---------------------------------------------------------------------------------
    def route(self, x, weight, bias, top_k, *, src=None):
        """kernels/router.py: the bf16 router GEMM + bias, top-k and softmax in one kernel (int32 ids). x None: the
        kernel remakes the rows from ``src`` (the stream, rsqrt factors, norm weight: its ``norm``) as it reads them."""
        xs = x if x is not None else src[0]
        if (not _kernel_device(xs) or xs.dtype != BF16 or weight.dtype != BF16 or xs.dim() != 2 or xs.stride(-1) != 1
                or weight.dim() != 2 or not weight.is_contiguous() or (bias is not None and bias.dtype != BF16)
                or x is None and not (src[1].is_contiguous() and src[2].dtype == F32 and src[2].is_contiguous())):
            self._fallback("route", xs, weight)
            return super().route(x, weight, bias, top_k, src=src)
        from gptoss_fp8.kernels.router import router

        return router(xs, weight, None if bias is None else bias.contiguous(), top_k, pdl=self._pdl(xs),
                      norm=None if x is not None else src[1:])

    def moe_needs_rows(self, experts, router_weight):
        """False where ``config.moe_rows_from_stream`` is on, ``route`` and ``expert_ffn`` are this class's own (a
        subclass's, e.g. tests/mutations.py's, gets the rows), the experts run our FP8 kernels on ``quant``
        (``_experts_ok``; not DeepGEMM's) and the router weight is one our kernel takes: the router remakes
        the rows from ``Normed.src`` (kernels/router.py ``norm``), one [T, H] bf16 write a layer fewer."""
        if not (self.config.moe_rows_from_stream and self.config.gemm != "deep_gemm"
                and type(self).route is TritonOps.route and type(self).expert_ffn is TritonOps.expert_ffn
                and router_weight.dtype == BF16 and router_weight.dim() == 2 and router_weight.is_contiguous()):
            return True
        ex = experts if isinstance(experts, dict) else dict(experts.named_buffers(recurse=False))
        return not self._experts_ok(ex, router_weight.shape[-1])

    @staticmethod
    def _experts_ok(experts, h) -> bool:
        """Whether our expert kernels take these experts (rows of width h): FP8 with scales, a gate_up bias, H and
        I multiples of 16."""
        w13, w2 = experts["gate_up_proj"], experts["down_proj"]
        return (w13.dtype == FP8_DTYPE and w2.dtype == FP8_DTYPE and experts.get("gate_up_proj_scale_inv") is not None
                and experts.get("down_proj_scale_inv") is not None and experts.get("gate_up_proj_bias") is not None
                and h % 16 == 0 and w2.shape[-1] % 16 == 0 and w13.shape[1] == 2 * w2.shape[-1])

    # --- expert FFN ----------------------------------------------------------------------------
    def expert_ffn(self, x, idx, experts, first_expert, limit, partial=False, *, xq=None):
        """x None (``moe_needs_rows`` False): the kernels on ``xq`` alone."""
        w13, w2 = experts["gate_up_proj"], experts["down_proj"]
        s13, s2 = experts.get("gate_up_proj_scale_inv"), experts.get("down_proj_scale_inv")
        b13, b2 = experts.get("gate_up_proj_bias"), experts.get("down_proj_bias")
        xs = x if x is not None else xq[0]  # (its shape and device)
        h = xs.shape[-1]
        if (not _kernel_device(xs) or (x is not None and x.dtype != BF16) or xs.dim() != 2
                or not self._experts_ok(experts, h)):
            # The kernels need FP8 experts with scales, a gate_up bias, H and I multiples of 16.
            assert x is not None, "expert_ffn without rows: only where moe_needs_rows said the kernels take xq"
            self._fallback("expert_ffn", x, w13, w2)
            return super().expert_ffn(x, idx, experts, first_expert, limit, partial, xq=xq)
        t, k = idx.shape
        n_local = w13.shape[0]
        if self.config.gemm == "deep_gemm":
            # kernels/deepgemm.py: both grouped GEMMs on DeepGEMM, the biases, SwiGLU and FP8
            # quantization in our kernels around them; same per-(token, slot) contract (``partial``:
            # the bf16 down products widened to float32, no bias)
            from gptoss_fp8.kernels import deepgemm

            y = deepgemm.expert_slots(x, idx.to(torch.int32), w13, s13, b13, w2, s2, None if partial else b2,
                                      first_expert, limit, F32 if partial else BF16, x_quant=xq)
        else:
            # The kernel always adds a bias; a zero bias leaves the fp32 partial products exact.
            b2_kernel = b2 if (b2 is not None and not partial) else torch.zeros(n_local, h, dtype=F32, device=xs.device)
            from gptoss_fp8.kernels.moe import moe_expert_slots

            # per-(token, slot) rows [T*k, H]; slots routed to other ranks are zero. A rank's expert
            # slices may be views: the kernels want them contiguous.
            c = [a.contiguous() for a in (w13, s13, b13, w2, s2, b2_kernel)]
            y = moe_expert_slots(x, idx.to(torch.int32), *c, first_expert, limit, self.config,
                                 F32 if partial else BF16, zero_foreign=True, x_quant=xq)
        y = y.view(t, k, h)
        if not partial:
            return y, None  # bf16 (see the module docstring): values identical to the float32 contract
        bias_out = torch.zeros(t, k, h, dtype=F32, device=xs.device)
        if b2 is not None:
            local = idx.long() - first_expert
            here = (local >= 0) & (local < n_local)
            bias_out = torch.where(here[..., None], b2[local.clamp(0, n_local - 1)].float(), bias_out)
        return y, bias_out

    def moe_combine(self, y, weights, out=None):
        if (not _kernel_device(y) or y.dtype not in (BF16, F32) or y.stride(-1) != 1
                or (out is not None and (out.dtype != BF16 or out.stride(-1) != 1))):
            self._fallback("moe_combine", y, weights)
            return super().moe_combine(y, weights, out)
        from gptoss_fp8.kernels.moe import moe_combine

        return moe_combine(y, weights, out=out)  # (into out's rows: no copy)

    def moe_combine_add_rms_norm(self, x, y, weights, norm_weight, eps, *, rows=True, out=None):
        """The MoE's weighted combine, the residual add and the next norm in one pass (norm.py); ``out``'s rows
        written by the kernel itself (the chunked MoE: no [T, H] combine written and read back)."""
        if (not self._norm_ok(x, norm_weight) or y.dtype not in (BF16, F32) or y.stride(-1) != 1
                or y.shape[-1] != x.shape[-1] or y.numel() != weights.numel() * x.shape[-1]
                or (out is not None and not self._out_ok(x, out, rows))):
            self._fallback("moe_combine_add_rms_norm", x, y, weights)
            return super().moe_combine_add_rms_norm(x, y, weights, norm_weight, eps, rows=rows, out=out)
        return self._norm(x, y, norm_weight, eps, combine=weights, rows=rows, out=out)

    def norm_out(self, x, rows=True):
        """The norm kernel's form where it runs on x: the new x, the normed rows (None for ``rows=False`` in
        bf16) and their quantization (fp8 [T, H], float32 scale [T, ceil(H/128)])."""
        if not (_kernel_device(x) and x.dim() == 2 and x.dtype in (BF16, torch.float16)):
            return super().norm_out(x, rows)
        from gptoss_fp8.kernels.norm import norm_buffers

        xo, y, q, s = norm_buffers(x, rows or x.dtype != BF16)
        return xo, Normed(y, (q, s))

    @staticmethod
    def _out_ok(x, out, rows) -> bool:
        """Whether ``out`` is ``norm_out``'s form for x's rows (the kernel writes there)."""
        xo, h = out

        def fits(t, dtype, shape) -> bool:
            return t is not None and tuple(t.shape) == shape and t.dtype == dtype and t.stride(-1) == 1

        n = tuple(x.shape)
        return (fits(xo, x.dtype, n) and h.quant is not None and fits(h.quant[0], FP8_DTYPE, n)
                and fits(h.quant[1], F32, (n[0], -(-n[1] // 128)))
                and (fits(h.y, x.dtype, n) if h.y is not None or rows or x.dtype != BF16 else True))

    # --- norms ---------------------------------------------------------------------------------
    def _norm_ok(self, x, weight) -> bool:
        return (_kernel_device(x) and x.dim() == 2 and x.dtype in (BF16, torch.float16) and x.stride(-1) == 1
                and weight.dtype == F32 and weight.is_contiguous())

    def rms_norm(self, x, weight, eps, *, rows=True):
        if not self._norm_ok(x, weight):
            self._fallback("rms_norm", x, weight)
            return super().rms_norm(x, weight, eps, rows=rows)
        return self._norm(x, None, weight, eps, rows=rows, src=not rows)[1]

    def add_rms_norm(self, x, delta, weight, eps, *, rows=True):
        """``rows=False``: the Normed carries ``src`` (the new x and each row's rsqrt factor: ``moe_needs_rows``)."""
        if not self._norm_ok(x, weight) or delta.shape != x.shape or delta.stride(-1) != 1:
            self._fallback("add_rms_norm", x, delta, weight)
            return super().add_rms_norm(x, delta, weight, eps, rows=rows)
        return self._norm(x, delta, weight, eps, rows=rows, src=not rows)

    def _norm(self, x, delta, weight, eps, combine=None, rows=True, out=None, src=False):
        """The norm kernel with the output's FP8 quantization in the same pass: (new x, Normed). ``rows=False``
        (a bf16 stream: the one ``linears`` takes as None): the bf16 rows not written, ``Normed.y`` None.
        ``out``: ``norm_out``'s rows to write (checked by ``_out_ok``). ``src`` (with rows left out): each row's
        rsqrt factor written too, ``Normed.src`` = (new x, those, weight), from which the router remakes the rows."""
        from gptoss_fp8.kernels.norm import norm_tile, rms_norm_quant

        into = None if out is None else (out[0], out[1].y, *out[1].quant)
        rows = rows or x.dtype != BF16
        rstd = torch.empty(x.shape[0], dtype=F32, device=x.device) if src and not rows else None
        tile = None if delta is not None else norm_tile(x.shape[-1], True, False, self.config.norm_stream_rows)
        xo, y, quant = rms_norm_quant(x, delta, weight, eps, combine, pdl=self._pdl(x), rows=rows, out=into, rstd=rstd,
                                      tile=tile)
        return xo, Normed(y, quant, None if rstd is None else (xo, rstd, weight))

    # --- attention -----------------------------------------------------------------------------
    def attention_cached(self, q, k_cache, v_cache, lengths, sinks, sm_scale, window):
        """kernels/attention_decode.py on the cache as it lies, no copy and no host read: a full
        layer by lengths; a sliding layer's ring (rows <= window) with ``ring=True``: one new query
        sees every row the ring holds (kernel docstring), so the kernel caps lengths at the ring's
        rows on the device. fp32 online softmax (the spec: bf16), keys of a wrapped ring in row
        order (the spec: position order); the sink enters once across the KV splits."""
        b, kvh, m, d = q.shape
        rows = k_cache.shape[1]
        ring = window > 0
        if (not _kernel_device(q) or q.dtype != BF16 or k_cache.dtype != BF16 or v_cache.dtype != BF16
                or d not in (16, 32, 64, 128, 256) or not sinks.is_floating_point() or k_cache.stride(-1) != 1
                or v_cache.stride(-1) != 1 or lengths.dtype != torch.int32 or (ring and rows > window)):
            # the kernel takes bf16 caches with a power-of-two head_dim in 16..256 and int32
            # lengths; a ring longer than the window would need position order (never built so)
            self._fallback("attention", q, k_cache)
            return super().attention_cached(q, k_cache, v_cache, lengths, sinks, sm_scale, window)
        from gptoss_fp8.kernels.attention_decode import attention_decode

        o = attention_decode(q.reshape(b, 1, kvh * m, d), k_cache, v_cache, lengths, sinks.reshape(-1).contiguous(),
                             sliding_window=0, sm_scale=sm_scale, config=self.config, ring=ring)
        return o.reshape(b, -1)

    def attention(self, q, k, v, sinks, sm_scale, window, rope=None):
        """The prefill kernels; with ``rope`` (q not yet rotated) q is rotated where a pass over it is made
        anyway (``_fused_rope``: the FP8 quantization of a full layer, the window layers' Triton kernel),
        else by ``rope`` first."""
        if rope is not None and not (self._fused_rope(window, q.shape[0]) and self._prefill_kernel_ok(q, k, v, sinks)):
            q, rope = self._rotated_q(q, rope), None
        if not self._prefill_kernel_ok(q, k, v, sinks):
            # attention_prefill takes bf16 q/k/v with a power-of-two head_dim in 16..256.
            self._fallback("attention", q, k, v)
            return super().attention(q, k, v, sinks, sm_scale, window)
        return self._attention_prefill(q, k, v, sinks, sm_scale, window, 0, rope)

    def attention_out(self, q, k, v, sinks, sm_scale, window, rope=None, rows=True):
        """A window layer longer than its window on the Triton prefill kernel with a tile of whole 128-column
        groups (the default: four heads a program) and ``rows=False``: the kernel writes o_proj's input
        quantization in place of its bf16 rows (``attention_prefill(quant_out=True)``, act_quant's bits; one [T,
        Hq * D] write and read and a launch fewer a layer). q a ``QuantQ`` (``linears_q8``): the FP8 attention on
        it (``attention_prefill(q_scale=)``). A full layer under ``--attention fp8`` with ``attention_fp8_quant_out``
        (opt-in): the FP8 kernel writes the quantization itself, two heads a program (act_quant after it where its
        rules do not hold). Everything else: the rows (``attention``)."""
        if isinstance(q, QuantQ):
            from gptoss_fp8.kernels.attention import attention_prefill

            fused = not rows and self.config.attention_fp8_quant_out
            o = attention_prefill(q.q8, _rows(k), _rows(v), sinks.reshape(-1).contiguous(), sliding_window=window,
                                  sm_scale=sm_scale, config=self.config, fp8=True, q_scale=q.scale, quant_out=fused,
                                  p_code=self.attention_p_code)
            return Normed(None, o) if fused else Normed(o.reshape(o.shape[0], -1))
        if (not rows and self.config.attention_fp8_quant_out and type(self).attention is TritonOps.attention
                and self.fp8_attention(window) and self._prefill_kernel_ok(q, k, v, sinks)
                and (rope is None or self._fused_rope(window, q.shape[0]))):
            # a full layer under --attention fp8: its kernel writes o_proj's input quantization
            # (``attention_fp8_quant_out``; act_quant after the kernel where it cannot)
            return Normed(None, self._attention_prefill(q, k, v, sinks, sm_scale, window, 0, rope, quant_out=True))
        if rows or not self._quant_out_ok(q, k, v, sinks, window):
            return super().attention_out(q, k, v, sinks, sm_scale, window, rope=rope, rows=rows)
        from gptoss_fp8.kernels.attention import attention_prefill

        if rope is not None:  # (rotated by the kernel: ``_fused_rope`` holds for these windows)
            rope = tuple(t.float().contiguous() for t in rope)
        n, kvh, m, d = q.shape
        o = attention_prefill(q.reshape(n, kvh * m, d), _rows(k), _rows(v), sinks.reshape(-1).contiguous(),
                              sliding_window=window, sm_scale=sm_scale, config=self.config, rope=rope, quant_out=True)
        return Normed(None, o)

    def _quant_out_ok(self, q, k, v, sinks, window: int) -> bool:
        """Whether ``attention_out`` of these inputs runs the Triton window kernel with the quantization fused: the
        option on, this class's ``attention`` (a subclass's own, e.g. tests/mutations.py's, runs as it is), a bf16
        window layer longer than its window (``_fused_rope``'s rule), and the tile's heads holding whole groups."""
        from gptoss_fp8.kernels.attention import quant_out_fused

        n, kvh, m, d = q.shape
        return (self.config.attention_quant_out and type(self).attention is TritonOps.attention
                and 0 < window < n and not self.fp8_attention(window) and self._fused_rope(window, n)
                and self._prefill_kernel_ok(q, k, v, sinks)
                and quant_out_fused(d, self.config.prefill_tile(q.is_cuda, True, m).pack))

    def _fused_rope(self, window: int, n: int) -> bool:
        """Whether the prefill attention of n rows rotates q itself (``attention``'s rope): where it reads q in
        a pass of its own, the FP8 quantization (full layers under ``--attention fp8``; kernels/attn_quant.py)
        or the Triton kernel of a window layer longer than its window (kernels/attention.py's ROPE_Q), with
        this class's rope kernel (a subclass's own ``rope``, e.g. tests/mutations.py's, is applied unfused).
        The bf16 full layers' Gluon kernel (which also takes a window layer no longer than its window) loads
        q by TMA: rotated first there (kernels/rope.py), as on FlashInfer's path."""
        return (type(self).rope is TritonOps.rope and self.rope_kernel and self.config.attention_backend != "flashinfer"
                and (self.fp8_attention(window) or 0 < window < n))

    def attention_chunk(self, q, k, v, sinks, sm_scale, window, q_offset):
        """A later prompt chunk: the same kernel with its query offset (q's rows at key positions
        q_offset.. of k / v [q_offset + T, KV, D]); the same fallback as ``attention``."""
        if not self._prefill_kernel_ok(q, k, v, sinks):
            self._fallback("attention", q, k, v)
            return super().attention_chunk(q, k, v, sinks, sm_scale, window, q_offset)
        return self._attention_prefill(q, k, v, sinks, sm_scale, window, q_offset)

    def attention_segments(self, q, k, v, sinks, sm_scale, window, keys):
        """Several sequences' chunks after their cached keys (``prefill_many``) in one launch of the Triton prefill
        kernel (``attention_prefill``'s k_starts / q_offsets: each chunk's keys where they lie, a full layer's in the
        cache; with ``config.attention_gluon_segments`` a full layer's bf16 on the Gluon kernel). ``--attention fp8``
        on a full layer: the same launch on e4m3 operands, each chunk quantized as its own ``attention_chunk`` would
        (``attn_quant.SegmentPlan``, made once a step and kept on ``keys``), so each sequence's rows are those of
        its chunk alone. One chunk, FlashInfer or ``config.attention_segments`` off: chunk by chunk."""
        if (len(keys) < 2 or not self.config.attention_segments
                or self.config.attention_backend == "flashinfer" or not self._prefill_kernel_ok(q, k, v, sinks)):
            return super().attention_segments(q, k, v, sinks, sm_scale, window, keys)
        from gptoss_fp8.kernels.attention import attention_prefill
        from gptoss_fp8.kernels.attn_quant import SegmentPlan

        n, kvh, m, d = q.shape
        cu, k_starts, q_offsets = keys.device(q.device)
        plan = None
        if self.fp8_attention(window):
            plan = keys.memo.get(("fp8", q.device))
            if plan is None:
                plan = keys.memo[("fp8", q.device)] = SegmentPlan(keys.rows, keys.starts, keys.offsets, q.device)
        o = attention_prefill(q.reshape(n, kvh * m, d), _rows(k), _rows(v), sinks.reshape(-1).contiguous(), cu,
                              keys.max_rows, sliding_window=window, sm_scale=sm_scale, config=self.config,
                              k_starts=k_starts, q_offsets=q_offsets, fp8=plan is not None, fp8_plan=plan,
                              p_code=self.attention_p_code if plan is not None else "e4m3")
        return o.reshape(n, -1)

    @staticmethod
    def _prefill_kernel_ok(q, k, v, sinks) -> bool:
        return (_kernel_device(q) and q.dtype == BF16 and k.dtype == BF16 and v.dtype == BF16
                and q.shape[-1] in (16, 32, 64, 128, 256) and sinks.is_floating_point())

    def _attention_prefill(self, q, k, v, sinks, sm_scale, window, q_offset, rope=None, quant_out=False):
        from gptoss_fp8.kernels import flashinfer_attention as fi
        from gptoss_fp8.kernels.attention import attention_prefill

        n, kvh, m, d = q.shape
        fp8 = self.fp8_attention(window)
        if self.config.attention_backend == "flashinfer" and not fp8 and not q_offset and d in fi.HEAD_DIMS:
            # a whole prompt in bf16 on FlashInfer; FP8, chunks after cached keys and other head
            # dims have no FlashInfer path here (kernels/flashinfer_attention.py) and stay on ours
            fi.require()
            return fi.prefill(q.reshape(n, kvh * m, d), _rows(k), _rows(v), sinks.reshape(-1), sm_scale,
                              window).reshape(n, -1)
        # k, v may be strided views (v is a column slice of the fused q/k/v GEMM's output): the
        # kernel reads rows by stride, so no copy
        if rope is not None:  # (the kernels' tables: fp32, contiguous, row t for q's row t)
            rope = tuple(t.float().contiguous() for t in rope)
        o = attention_prefill(q.reshape(n, kvh * m, d), _rows(k), _rows(v), sinks.reshape(-1).contiguous(),
                              sliding_window=window, sm_scale=sm_scale, config=self.config,
                              fp8=fp8, q_offset=q_offset, rope=rope, quant_out=quant_out,
                              p_code=self.attention_p_code if fp8 else "e4m3")
        return o if quant_out else o.reshape(n, -1)

    # --- rope ----------------------------------------------------------------------------------
    def rope(self, x, cos, sin):
        d = x.shape[-1]
        if (not self.rope_kernel or not _kernel_device(x) or x.dim() != 3 or x.dtype not in (BF16, torch.float16, F32)
                or triton.next_power_of_2(d // 2) != d // 2 or cos.shape != (x.shape[0], d // 2)):
            # rope_qk needs D/2 a power of two and one cos/sin row per token (positions 0..T-1).
            self._fallback("rope", x, cos)
            return super().rope(x, cos, sin)
        from gptoss_fp8.kernels.rope import rope_qk

        pos = self._arange(x.shape[0], x.device)
        _, out = rope_qk(None, x if x.stride(-1) == 1 else x.contiguous(), pos,
                         cos.float().contiguous(), sin.float().contiguous())
        return out


    def rope_append(self, q, k, v, cos, sin, cache, i, step):
        """kernels/rope.py ``rope_append``: q and k rotated, k and v written to the layer's cache
        rows in one launch (rope_qk's fp32 arithmetic, so the cache holds what ``rope`` + ``KVCache.append``
        would write). A subclass overriding ``rope`` gets the unfused form, so its rope acts in decode too."""
        d = q.shape[-1]
        kc, vc = cache.k[i], cache.v[i]
        if type(self).rope is not TritonOps.rope:  # a subclass's own rope (the verify mutation hooks): unfused
            return super().rope_append(q, k, v, cos, sin, cache, i, step)
        if (not self.rope_kernel or not _kernel_device(q) or q.dtype != BF16 or k.dtype != BF16 or v.dtype != BF16
                or kc.dtype != BF16 or vc.dtype != BF16 or triton.next_power_of_2(d // 2) != d // 2
                or cos.shape != (q.shape[0], d // 2) or kc.stride(-1) != 1 or vc.stride(-1) != 1):
            self._fallback("rope", q, cos)
            return super().rope_append(q, k, v, cos, sin, cache, i, step)
        from gptoss_fp8.kernels.rope import rope_append

        pos = self._arange(q.shape[0], q.device)
        return rope_append(_rows(q), _rows(k), _rows(v), pos, cos.float().contiguous(), sin.float().contiguous(), kc, vc,
                           step.slot(cache.rows(i), not cache.is_ring(i)), pdl=self._pdl(q[:, 0]))

    def _arange(self, n: int, device) -> torch.Tensor:
        """int32 0..n - 1 on ``device``, cached (the rope kernels' positions for per-token cos / sin rows)."""
        key = (n, device)
        pos = self._positions.get(key)
        if pos is None:
            pos = self._positions[key] = torch.arange(n, dtype=torch.int32, device=device)
        return pos


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (strided rows and heads are fine), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _version(t: torch.Tensor) -> int:
    """In-place modification counter (inference-mode tensors have none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1

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

Attention, RMSNorm, RoPE, routing and the MoE combine are the same in both backends (bf16 / fp32
exactly as the reference); ``with_attention("fp8")`` (``--attention fp8``) makes every backend's
full-attention prefill ``spec.attention_fp8`` (Q, K, V and P in e4m3; the triton backend: its FP8
kernels); sliding-window layers stay bf16 (``ReferenceOps.fp8_attention``); ``with_attention("fp8-lin")`` the same
with P's e4m3 codes made from the scores without 2^x (``spec.attention_fp8(p_code="lin")``).
Every op's arithmetic is written once, in gptoss_fp8/spec.py; the
classes here only pick which spec function each op of a mode is. A GPU backend
(model/triton_ops.py; model/backends.py picks a backend by name) overrides what it accelerates and
must agree with ``w8a8-cpu`` to fp32-accumulation noise. Nothing here imports Triton.

FP8 weights are dequantized once per model, not once per call: each CPU backend keeps its
dequantized copies (``PreparedWeights``; bf16 in ``reference``, float32 in ``w8a8-cpu``, the exact
tensors a call would make), so a decode step does not redo the model's dequantization. Every
dense FP8 weight is kept; experts are kept up to ``expert_cache_bytes`` (then dequantized per
selected expert per call, as the spec does), so a large model's experts are not doubled in memory.

Quantized activations travel explicitly: a norm returns ``Normed`` (the normed rows and, when a
backend computed it in the same pass, their ``quantize_act``), and the linears and the expert FFN
that read those rows take it as ``xq``. The CPU backends return ``quant=None`` and ignore ``xq``
(they quantize themselves: the spec depends on nothing a kernel computed). Where a backend's GEMMs
read only ``xq`` (``needs_rows(projs)`` False: the triton backend's FP8 q / k / v), the model asks the
norm before them for ``rows=False`` and passes their x as None: the bf16 rows are never written (one
[T, H] write a layer fewer); every backend that says True gets its rows as before. The MoE in chunks
writes each chunk's combine, residual add and next norm into its rows of the layer's results: ``norm_out``
gives the buffers in the backend's form, ``moe_combine_add_rms_norm(..., out=)`` takes row slices of them.
The attention before o_proj works the same way: ``attention_out(..., rows=False)`` (asked where ``needs_rows``
says o_proj reads only ``xq``) returns a ``Normed`` whose rows a backend may leave out, their quantization
written by the attention kernel itself (the triton backend's window layers). The MoE likewise: where
``moe_needs_rows`` is False (the triton backend's ``moe_rows_from_stream``) the post-attention norm leaves its
rows out and its ``Normed.src`` (the new stream and each row's rsqrt factor) lets ``route(None, ..., src=)``
remake them bit for bit; ``expert_ffn`` then gets x None beside ``xq``. o_proj's residual add: ``linear_add``
returns x + o_proj(o) from a GEMM that adds it in its epilogue, or None (every CPU backend): the model then
runs ``linear`` and ``add_rms_norm`` as before, else ``rms_norm`` of the new stream. Q of a full layer under FP8
attention: ``linears_q8`` returns Q already rotated and quantized for the FP8 attention (``QuantQ``, from the q / k
/ v GEMM's epilogue) beside k and v, or None (every CPU backend): the model then runs ``linears`` as before;
``attention_out`` takes a ``QuantQ`` where the backend made one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from gptoss_fp8 import spec
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.kernels import device_ints
from gptoss_fp8.parallel import Parallel
from gptoss_fp8.quant.fp8 import FP8_DTYPE, FP8_MAX, block_gemm_dequantized, dequantize_weight_blocks, quantize_act

EXPERT_CACHE_BYTES = 512 * 1024**2  # the default of ReferenceOps.expert_cache_bytes

MODES = {"weights": "reference", "w8a8": "w8a8-cpu"}
ATTENTION_KINDS = ("bf16", "fp8", "fp8-lin")  # ``ReferenceOps.attention_kind``: prefill attention's numerics


def check_attention_kind(kind: str) -> str:
    """``kind`` if it is one of ATTENTION_KINDS; else GptOssFp8Error (one line)."""
    if kind not in ATTENTION_KINDS:
        raise GptOssFp8Error(f"--attention {kind!r}: choose one of {', '.join(ATTENTION_KINDS)}")
    return kind

Quant = tuple[torch.Tensor, torch.Tensor]  # (x_fp8 [T, K], scale float32 [T, ceil(K/128)]) = quantize_act(x)


class Normed(NamedTuple):
    """A norm's output: ``y`` bf16 [T, H], and ``quant`` = quant/fp8.quantize_act(y) (fp8 [T, H],
    float32 scale [T, ceil(H/128)]) when the backend computed it in the same pass, else None. ``y`` is None
    when the caller asked for the quantization alone (a norm's ``rows=False``, given only where
    ``ReferenceOps.needs_rows`` / ``moe_needs_rows`` said the consumers take ``quant``). ``src`` (a backend's,
    where it left the rows out): (the normed stream x bf16 [T, H], each row's rsqrt factor float32 [T], the norm
    weight float32 [H]), from which ``normed_rows`` remakes y bit for bit (the router reads them so)."""

    y: torch.Tensor | None
    quant: Quant | None = None
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def n(self) -> int:
        """The number of rows."""
        return (self.y if self.y is not None else self.quant[0]).shape[0]

    def rows(self, a: int, b: int) -> Normed:
        """Rows a..b of each (the chunked MoE's slices)."""
        q = None if self.quant is None else (self.quant[0][a:b], self.quant[1][a:b])
        src = None if self.src is None else (self.src[0][a:b], self.src[1][a:b], self.src[2])
        return Normed(None if self.y is None else self.y[a:b], q, src)

    def select(self, idx: torch.Tensor) -> Normed:
        """The rows idx (int tensor) of each (a prefill's last layer: the rows whose logits are returned)."""
        q = None if self.quant is None else (self.quant[0].index_select(0, idx), self.quant[1].index_select(0, idx))
        src = None if self.src is None else (self.src[0].index_select(0, idx), self.src[1].index_select(0, idx),
                                             self.src[2])
        return Normed(None if self.y is None else self.y.index_select(0, idx), q, src)


class QuantQ(NamedTuple):
    """A prompt's Q made for the FP8 attention by the GEMM that computes it (``ReferenceOps.linears_q8``): rotated at
    positions 0.. and quantized as ``quant/attn_fp8.quantize_qk`` (one scale per head and 64-row block): ``q8`` e4m3
    [T, Hq, D], ``scale`` float32 [Hq, ceil(T / 64)]. Only the backend that made it reads it (``attention_out``)."""

    q8: torch.Tensor
    scale: torch.Tensor


def normed_rows(src: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``Normed.src``'s rows: bf16((x * rstd) * weight) in fp32, the norm's own rounding (``spec.rms_norm`` with
    its rsqrt factor given; kernels/norm.py computes the same products)."""
    x, rstd, weight = src
    return ((x.float() * rstd[:, None]) * weight.float()).to(x.dtype)


def _write_normed(out: tuple[torch.Tensor, Normed], x: torch.Tensor, h: Normed) -> tuple[torch.Tensor, Normed]:
    """Copy a residual add + norm's results (x, h) into the rows ``out`` (``norm_out``'s form) and return
    ``out``: the quantization out holds is h's, or the spec's of h's rows where h has none (the same values)."""
    xo, ho = out
    xo.copy_(x)
    if ho.y is not None:
        ho.y.copy_(h.y)
    if ho.quant is not None:
        q, s = h.quant if h.quant is not None else quantize_act(h.y)
        ho.quant[0].copy_(q)
        ho.quant[1].copy_(s)
    return out


class ChunkKeys:
    """Where several sequences' prompt chunks find their keys (``ReferenceOps.attention_segments``, the
    serving engine's prompts of one step): chunk i is q's rows ``rows[i]``..``rows[i + 1] - 1``, at key
    positions ``offsets[i]``.. of its keys, which are rows ``starts[i]`` .. ``starts[i] + offsets[i] + n_i
    - 1`` of the key tensor (a KV cache's [batch * rows] view, or keys packed per chunk). Host ints;
    ``device`` gives the kernels' int32 tensors (cu_seqlens, k_starts, q_offsets), copied once per device
    from pinned memory without a host sync."""

    def __init__(self, rows: list[int], starts: list[int], offsets: list[int]):
        assert len(rows) == len(starts) + 1 == len(offsets) + 1, f"rows {rows} starts {starts} offsets {offsets}"
        self.rows, self.starts, self.offsets = list(rows), list(starts), list(offsets)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.memo: dict = {}  # what a backend derives from these chunks once a step (TritonOps: its FP8 block tables)

    def __len__(self) -> int:
        return len(self.starts)

    def chunks(self):
        """(first query row, end query row, first key row, query offset) of each chunk."""
        return zip(self.rows[:-1], self.rows[1:], self.starts, self.offsets, strict=True)

    @property
    def max_rows(self) -> int:
        """The longest chunk's query rows."""
        return max((b - a for a, b in zip(self.rows[:-1], self.rows[1:], strict=True)), default=0)

    def device(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cu_seqlens int32 [B + 1], k_starts int32 [B], q_offsets int32 [B]) on ``dev``."""
        dev = torch.device(dev)
        got = self._on.get(dev)
        if got is None:
            t = device_ints(self.rows + self.starts + self.offsets, dev, torch.int32)
            b = len(self)
            got = self._on[dev] = (t[:b + 1], t[b + 1:2 * b + 1], t[2 * b + 1:])
        return got


class PreparedWeights:
    """Dequantized copies of FP8 weights, made on first use and returned by every later call with
    the same weight: bit for bit what the call would have made (``make()``), without making it
    again. Keyed on the weight tensor (weakly: a freed model's copies go with it) and, per entry,
    an expert index (None: a dense weight) and a dtype; checked against the scale tensor and both
    tensors' version counters, so an in-place change of either is seen (tensors made under
    inference mode have no version counter: never kept). Dense weights are always kept, experts
    while the experts kept total at most ``expert_bytes``, first come first kept."""

    def __init__(self, expert_bytes: int = EXPERT_CACHE_BYTES):
        self.expert_bytes = expert_bytes
        self.expert_bytes_kept = 0
        self._kept = WeakIdKeyDictionary()  # weight -> {(expert, dtype): (scale_inv, versions, copy)}

    def get(self, w: torch.Tensor, scale_inv: torch.Tensor | None, dtype: torch.dtype,
            make: Callable[[], torch.Tensor], expert: int | None = None) -> torch.Tensor:
        try:
            versions = (w._version, None if scale_inv is None else scale_inv._version)
        except RuntimeError:  # an inference tensor: a change could not be seen
            return make()
        entries = self._kept.get(w)
        if entries is None:
            entries = self._kept[w] = {}
        key = (expert, dtype)
        old = entries.get(key)
        if old is not None and old[0] is scale_inv and old[1] == versions:
            return old[2]
        t = make()
        if expert is None or old is not None or self.expert_bytes_kept + t.nbytes <= self.expert_bytes:
            if expert is not None and old is None:
                self.expert_bytes_kept += t.nbytes
            entries[key] = (scale_inv, versions, t)
        return t

    def __len__(self) -> int:
        """How many copies are kept."""
        return sum(len(v) for v in self._kept.values())


class ReferenceOps:
    """bf16 activations, FP8 weights dequantized (the ``weights`` mode).

    ``expert_cache_bytes``: how many bytes of dequantized experts to keep for reuse
    (``PreparedWeights``; dense FP8 weights are always kept); 0 keeps none."""

    name = "reference"
    # Ops handed to the spec instead of a kernel (op -> calls) and the shapes that caused them: a
    # GPU backend fills these (verify reports them); None in the CPU backends, which are the spec.
    spec_fallbacks: dict[str, int] | None = None
    fallback_shapes: dict[str, set[str]] | None = None
    # Whether dequantized weights are kept for reuse (the CPU backends); a GPU backend whose
    # kernels read FP8 weights directly sets False (its rare spec fallbacks then hold no second copy).
    keep_prepared = True
    # Prefill attention's numerics (``--attention``): "bf16" (the reference's), or "fp8": the
    # full-attention layers' Q, K, V and P in e4m3 (``spec.attention_fp8`` here, the FP8 kernels in
    # the triton backend); the sliding-window layers stay bf16 (``fp8_attention``). Decode
    # (``attention_cached``) stays bf16 in both: it reads the bf16 KV cache, memory-bound. "fp8-lin": "fp8" with
    # P's e4m3 codes made from the scores without 2^x (``spec.attention_fp8(p_code="lin")``, ``attention_p_code``).
    attention_kind = "bf16"
    # What a Q / K / V block's amax maps to under FP8 attention (spec.attention_fp8's fp8_max): 448;
    # the verdict's noise grids set others (verify/noise.py). W8A8CpuOps ties it to its act_max.
    attention_fp8_max = FP8_MAX

    def __init__(self, expert_cache_bytes: int = EXPERT_CACHE_BYTES):
        self.prepared = PreparedWeights(expert_cache_bytes)

    def with_attention(self, kind: str) -> ReferenceOps:
        """Set the prefill attention's numerics (``ATTENTION_KINDS``); returns self. Raises
        GptOssFp8Error for an unknown kind."""
        self.attention_kind = check_attention_kind(kind)
        return self

    def _prepared(self, w: torch.Tensor, scale_inv: torch.Tensor | None, dtype: torch.dtype,
                  make: Callable[[], torch.Tensor], expert: int | None = None) -> torch.Tensor:
        prepared = getattr(self, "prepared", None) if self.keep_prepared else None
        return make() if prepared is None else prepared.get(w, scale_inv, dtype, make, expert)

    def _expert_weight(self, dtype: torch.dtype) -> spec.ExpertWeight:
        """The expert FFN's operand maker for ``dtype`` (spec.expert_weight_bf16 / _f32), through
        the prepared copies."""
        make = spec.expert_weight_bf16 if dtype == torch.bfloat16 else spec.expert_weight_f32

        def weight(w: torch.Tensor, scale_inv: torch.Tensor | None, e: int) -> torch.Tensor:
            if w.dtype != FP8_DTYPE:
                return make(w, scale_inv, e)
            return self._prepared(w, scale_inv, dtype, lambda: make(w, scale_inv, e), expert=e)

        return weight

    # --- GEMMs -------------------------------------------------------------------------------
    def weight(self, w: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
        """A weight as bf16 [N, K] (dequantized when FP8; prepared once, ``PreparedWeights``)."""
        if w.dtype != FP8_DTYPE:
            return w
        return self._prepared(w, scale_inv, torch.bfloat16, lambda: spec.bf16_weight(w, scale_inv))

    def linear(self, x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None,
               bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16, *,
               xq: Quant | None = None) -> torch.Tensor:
        """y = x @ W^T + b: x bf16 [T, K], W [N, K] (bf16, or fp8 with block scales), b [N] -> [T, N].
        bf16 out: bias fused as in torch.nn.Linear (the reference's projections). float32 out (a
        partial sum of a sharded layer, rounded once after the all-reduce): fp32 product + bias.
        ``xq``: x's quantize_act if the caller has it (a backend may use it; this one does not)."""
        wd = self.weight(w, scale_inv)
        if out_dtype == torch.bfloat16:
            return F.linear(x, wd, bias)
        return F.linear(x.float(), wd.float(), None if bias is None else bias.float()).to(out_dtype)

    def linear_add(self, x: torch.Tensor | None, w: torch.Tensor, scale_inv: torch.Tensor | None,
                   bias: torch.Tensor | None, residual: torch.Tensor, *, xq: Quant | None = None) -> torch.Tensor | None:
        """``residual + linear(x, w, scale_inv, bias)`` (bf16 [T, N]: the delta rounded to bf16, then the bf16 add
        of ``spec.add_rms_norm``) from a GEMM that adds the residual in its epilogue, or None where this backend
        has none for the call: the caller then runs ``linear`` and ``add_rms_norm`` (whose add it would repeat).
        This backend: None."""
        return None

    def linears(self, x: torch.Tensor, projs: list[tuple], *, xq: Quant | None = None) -> list[torch.Tensor]:
        """Several projections of the same input (q, k, v): ``[linear(x, w, s, b, xq=xq) for (w, s, b)
        in projs]``. A backend may quantize x once and run them as one GEMM; the results are the same."""
        return [self.linear(x, w, s, b, xq=xq) for w, s, b in projs]

    def linears_q8(self, x: torch.Tensor | None, projs: list[tuple], rope: tuple[torch.Tensor, torch.Tensor],
                   window: int, *, xq: Quant | None = None) -> list | None:
        """A whole prompt's q / k / v (``linears``, x's rows at positions 0.., rope = (cos, sin) their rows) with q
        rotated and quantized for the FP8 attention of a layer of this window by the GEMM itself: [``QuantQ``, k,
        v], which ``attention_out`` takes as it would the bf16 q (the same result, bit for bit), or None where
        this backend has no such GEMM for the call (the caller then runs ``linears``). This backend: None."""
        return None

    # --- experts -------------------------------------------------------------------------------
    def route(self, x: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
              top_k: int, *, src: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE router (``spec.route``): (logits bf16 [T, E] = the bf16 linear with bias, expert
        ids [T, k] of the top-k logits sorted descending, weights bf16 [T, k] = softmax over those k
        logits in bf16). x None: the rows from ``src`` (``Normed.src``, where a norm left them out)."""
        return spec.route(normed_rows(src) if x is None else x, weight, bias, top_k)

    def moe_needs_rows(self, experts, router_weight: torch.Tensor) -> bool:
        """Whether the MoE block (``route``, ``expert_ffn``) reads its norm's bf16 rows: False where this backend's
        router remakes them from ``Normed.src`` and its expert GEMMs take ``quant``, so the norm before may leave
        them out (``rows=False``). experts: the experts' buffers (a dict, or the module holding them: read only
        where needed). This backend: True."""
        return True

    def expert_ffn(self, x: torch.Tensor, idx: torch.Tensor, experts: dict[str, torch.Tensor | None],
                   first_expert: int, limit: float, partial: bool = False, *,
                   xq: Quant | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Routed expert FFN on this rank's experts (and intermediate part).

        x bf16 [T, H]; idx int64 [T, k] global expert ids; experts: gate_up_proj [E_l, 2I_l, H]
        (+ _scale_inv, _bias [E_l, 2I_l]), down_proj [E_l, H, I_l] (+ _scale_inv, _bias [E_l, H] or
        None when another rank owns it); ``xq``: x's quantize_act if the caller has it. Returns
        (y, b), float32 [T, k, H] each, zeros for experts held elsewhere. Whole experts
        (``partial`` False): y = the bf16 per-expert outputs, bias included, b None. Intermediate
        dim split over ranks (``partial``): y = unrounded fp32 partial products of the down
        projection, b = the down bias where this rank owns it; the model sums both over ranks,
        rounds the sum to bf16 and then adds the bias (``add_bias_after_sum``), as the reference.
        This backend: ``spec.moe_experts_bf16`` (OpenAI's bf16 order).
        """
        return spec.moe_experts_bf16(x, idx, *_expert_tensors(experts), first_expert, limit, partial,
                                     weight=self._expert_weight(torch.bfloat16))

    def moe_combine(self, y: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum of per-slot expert outputs: y bf16 [T, k, H], weights bf16 [T, k] -> bf16
        [T, H] (``spec.moe_combine``: the reference's einsum, fp32 accumulation, one rounding).
        ``out`` (bf16 [T, H], e.g. rows of a larger buffer): written and returned (a backend writes
        there directly; here a copy)."""
        r = spec.moe_combine(y, weights)
        if out is None:
            return r
        out.copy_(r)
        return out

    # --- the rest: identical in every CPU backend ----------------------------------------------
    def all_reduce(self, t: torch.Tensor, par: Parallel) -> torch.Tensor:
        """Sum a partial result over the ranks of ``par`` (fp32 on the wire; identity on one rank)."""
        return par.all_reduce(t)

    def all_gather(self, t: torch.Tensor, par: Parallel, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along its last dim in rank order (``sizes``: each rank's
        width when they differ): the vocab-parallel logits [T, V_rank] -> [T, V]. A copy, exact;
        identity on one rank."""
        return par.all_gather(t, sizes, dim=-1)

    def add_bias_after_sum(self, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Combine all-reduced fp32 partial products y and bias b of a split expert down projection.
        The reference rounds the product, then adds the bias in bf16 (its mlp2 bias comes after
        the all-reduce)."""
        return y.to(torch.bfloat16) + b.to(torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, rows: bool = True) -> Normed:
        """``spec.rms_norm`` (fp32 RMSNorm, cast back to x's dtype; weight float32 [H]) as ``Normed``. ``rows=False``:
        as ``add_rms_norm``'s (this backend returns the rows)."""
        return Normed(spec.rms_norm(x, weight, eps))

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, *, rows: bool = True) -> tuple[torch.Tensor, Normed]:
        """Residual add of the bf16 stream (x + delta.to(x.dtype)), then ``rms_norm`` of the sum:
        (new x, normed) (``spec.add_rms_norm``). ``rows=False``: the caller reads only the normed rows'
        quantization (``needs_rows`` said so); a backend that computes one may leave ``y`` out (None).
        This one computes no quantization: it returns the rows."""
        xo, y = spec.add_rms_norm(x, delta, weight, eps)
        return xo, Normed(y)

    def moe_combine_add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, *, rows: bool = True,
                                 out: tuple[torch.Tensor, Normed] | None = None) -> tuple[torch.Tensor, Normed]:
        """``add_rms_norm(x, moe_combine(y, weights), ..., rows=rows)``: the MoE's residual add and the next
        norm. A backend may fuse the three; the values are the same. ``out`` (new x, Normed): rows of larger
        results (``norm_out``'s buffers, ``Normed.rows`` of them: the chunked MoE, each chunk's rows of the
        layer's whole), written and returned (a backend writes there directly; here a copy)."""
        got = self.add_rms_norm(x, self.moe_combine(y, weights), norm_weight, eps, rows=rows)
        return got if out is None else _write_normed(out, *got)

    def norm_out(self, x: torch.Tensor, rows: bool = True) -> tuple[torch.Tensor, Normed]:
        """Empty buffers for a residual add + norm of x's rows (bf16 [T, H]) in the form this backend's
        ``moe_combine_add_rms_norm(..., rows=rows)`` returns them, for its ``out`` (row slices of them). This
        backend: the new x and the normed rows (no quantization: see ``Normed``)."""
        return torch.empty_like(x), Normed(torch.empty_like(x))

    def needs_rows(self, projs: list[tuple]) -> bool:
        """Whether ``linear`` / ``linears`` over these projections (weight, scale_inv, bias) read a norm's bf16
        rows, not only their quantization (``Normed.quant``): when False, a norm feeding only them may be asked
        for ``rows=False`` and their x passed as None beside ``xq``. This backend quantizes for itself: True."""
        return True

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate halves of each head: x [T, heads, D]; cos/sin float32 [T, D/2], cast to x's dtype
        (``spec.apply_rope`` in x's dtype, as the reference)."""
        return spec.apply_rope(x, cos, sin)

    def rope_append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache, i: int, step) -> torch.Tensor:
        """A decode step's q / k / v of layer i: q [B, Hq, D] and k [B, KV, D] rotated (``rope``;
        cos / sin [B, D/2], row b sequence b's position), k and v [B, KV, D] stored in the cache
        (model/cache.py ``KVCache.append(i, step, k, v)``) -> q rotated. A backend may do the three
        in one pass (model/triton_ops.py); what the cache holds is the same."""
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        cache.append(i, step, k, v)
        return q

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  sm_scale: float, window: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Causal attention with per-head sinks as an extra softmax column (then dropped).

        q [T, KV, M, D], k/v [T, KV, D], sinks [KV * M]; window > 0: key j visible to query i iff
        i - window < j <= i. Returns [T, KV * M * D] in q's dtype (``spec.attention`` in q's dtype).
        ``rope`` = (cos, sin) [T, D/2] (row t for q's row t): q is not rotated yet; it is rotated here
        first by ``self.rope`` (k comes rotated). A backend may rotate it in a pass it makes anyway
        (model/triton_ops.py: in the FP8 quantization, in the window kernel); the values are the same.
        """
        if rope is not None:
            q = self._rotated_q(q, rope)
        return self._attend(q, k, v, sinks, sm_scale, window, 0)

    def _rotated_q(self, q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [T, KV, M, D] rotated by ``self.rope`` at rope's rows."""
        n, kvh, m, d = q.shape
        return self.rope(q.reshape(n, kvh * m, d), *rope).view(n, kvh, m, d)

    def fp8_attention(self, window: int) -> bool:
        """Whether a prefill attention of this window runs FP8 arithmetic: with ``attention_kind`` "fp8",
        the full-attention layers (window 0). A 128-key window layer is bound by reading Q and writing O
        (bf16 either way), not by its products: on the H200 at 128000 tokens bf16 takes 1.61 ms (1.40 with
        four heads a program since the twenty-sixth session) where FP8 takes 3.65 (its operands'
        quantization alone 1.27; BENCHMARKS.md, issue 34), so it stays bf16, exact as the reference's."""
        return self.attention_kind != "bf16" and not window

    @property
    def attention_p_code(self) -> str:
        """P's coding under FP8 attention (``spec.attention_fp8``'s p_code): "lin" with ``attention_kind`` "fp8-lin",
        else "e4m3" (2^x rounded)."""
        return "lin" if self.attention_kind == "fp8-lin" else "e4m3"

    def _attend(self, q, k, v, sinks, sm_scale, window, q_offset) -> torch.Tensor:
        n, kvh, m, d = q.shape
        if self.fp8_attention(window):  # Q / K / V on this backend's activation grid (verify/noise.py)
            return spec.attention_fp8(q.reshape(n, kvh * m, d), k, v, sinks.reshape(-1), sm_scale, window, q_offset,
                                      fp8_max=self.attention_fp8_max, p_code=self.attention_p_code).reshape(n, -1)
        return spec.attention(q.reshape(n, kvh * m, d), k, v, sinks.reshape(-1), sm_scale, window,
                              q_offset=q_offset).reshape(n, -1)

    def attention_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, sm_scale: float,
                      window: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None, rows: bool = True) -> Normed:
        """``attention`` as o_proj's input: ``Normed(y [T, KV * M * D], quant)``. ``rows=False`` (given only where
        ``needs_rows`` said o_proj reads ``xq`` alone): a backend may return y None beside the rows' quantization
        (``quantize_act``'s), computed where the attention writes its output. Here (every CPU backend) the rows
        alone; the ``triton`` backend's window layers write the quantization instead (kernels/attention.py
        ``quant_out``)."""
        return Normed(self.attention(q, k, v, sinks, sm_scale, window, rope=rope))

    def attention_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        sm_scale: float, window: int, q_offset: int) -> torch.Tensor:
        """``attention`` of a prompt chunk after cached keys: q [T, KV, M, D] at key positions
        q_offset..q_offset + T - 1 of k / v [q_offset + T, KV, D] (the cached keys, then the
        chunk's); the same masks and sinks -> [T, KV * M * D] (``spec.attention`` with q_offset).
        On CPU a prompt prefilled in chunks gives the whole prefill's bits (tests/test_model_chunks.py).
        Here the spec; the ``triton`` backend runs its prefill kernel with the query offset
        (kernels/attention.py ``attention_prefill(q_offset=)``)."""
        return self._attend(q, k, v, sinks, sm_scale, window, q_offset)

    def attention_segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                           sm_scale: float, window: int, keys: ChunkKeys) -> torch.Tensor:
        """``attention_chunk`` of several sequences' prompt chunks at once (``prefill_many``): q [T, KV, M, D]
        (rotated) holds the chunks' rows one after another, k / v [N, KV, D] their keys, where ``keys`` says
        (``ChunkKeys``: chunk i at key positions offsets[i].. of rows starts[i].. of k / v) -> [T, KV * M * D],
        each chunk's rows those of its own ``attention_chunk``. Here chunk by chunk; the ``triton`` backend
        runs them in one launch of its prefill kernel (kernels/attention.py ``k_starts`` / ``q_offsets``)."""
        out = [self.attention_chunk(q[a:b], k[k0:k0 + off + b - a], v[k0:k0 + off + b - a], sinks, sm_scale, window,
                                    off) for a, b, k0, off in keys.chunks()]
        return torch.cat(out) if len(out) != 1 else out[0]

    def attention_cached(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         lengths: torch.Tensor, sinks: torch.Tensor, sm_scale: float, window: int) -> torch.Tensor:
        """Decode attention over a KV cache (model/cache.py's layout), one new token per sequence.

        q [B, KV, M, D]: sequence b's new query, at position lengths[b] - 1; k_cache / v_cache
        [B, rows, KV, D]: the layer's cache, position p in row p % rows (a full layer: rows >=
        every length, so row p; a sliding layer: a ring), the new token's K / V already written;
        lengths int [B] (device): keys per sequence, the new one included. The same masks and sinks
        (once) as ``attention``: the keys of positions max(0, n - window) .. n - 1 (window 0: all)
        -> [B, KV * M * D]. Here: each sequence's visible keys gathered in position order and
        ``spec.attention`` (reads lengths on the host: the CPU spec); a GPU backend runs its
        split-KV decode kernel on the cache as it lies."""
        b_, kvh, m, d = q.shape
        rows = k_cache.shape[1]
        out = []
        for b, n in enumerate(lengths.tolist()):
            first = max(0, n - rows)
            if first == 0:
                k, v = k_cache[b, :n], v_cache[b, :n]
            else:  # a wrapped ring: positions first..n-1 from rows p % rows
                s = torch.arange(first, n, device=k_cache.device) % rows
                k, v = k_cache[b, s], v_cache[b, s]
            out.append(spec.attention(q[b:b + 1].reshape(1, kvh * m, d), k, v, sinks.reshape(-1), sm_scale,
                                      window, q_offset=n - 1 - first).reshape(1, -1))
        return torch.cat(out)


class W8A8CpuOps(ReferenceOps):
    """FP8 weights x FP8 activations (per-token 1x128 groups), fp32 accumulation: the ``w8a8`` mode."""

    name = "w8a8-cpu"
    act_max = FP8_MAX

    def __init__(self, act_max: float = FP8_MAX, expert_cache_bytes: int = EXPERT_CACHE_BYTES,
                 prepared: PreparedWeights | None = None):
        super().__init__(expert_cache_bytes)
        if prepared is not None:  # share another backend's copies (the verdict's grids: one set)
            self.prepared = prepared
        # quantize_act's fp8_max: 448, or another grid for the verdict's noise estimate (verify/noise.py)
        self.act_max = self.attention_fp8_max = act_max

    def linear(self, x, w, scale_inv, bias, out_dtype=torch.bfloat16, *, xq=None):
        if w.dtype != FP8_DTYPE:
            return super().linear(x, w, scale_inv, bias, out_dtype)
        assert scale_inv is not None, f"fp8 weight {tuple(w.shape)} without scale_inv"
        x_fp8, x_scale = quantize_act(x, fp8_max=self.act_max)
        wd = self._prepared(w, scale_inv, torch.float32, lambda: dequantize_weight_blocks(w, scale_inv))
        return block_gemm_dequantized(x_fp8, x_scale, wd, bias, out_dtype=out_dtype)  # = block_gemm_reference

    def add_bias_after_sum(self, y, b):
        """The w8a8 spec adds the bias in fp32 and rounds once (as block_gemm_reference)."""
        return (y + b).to(torch.bfloat16)

    def expert_ffn(self, x, idx, experts, first_expert, limit, partial=False, *, xq=None):
        """``spec.moe_experts_w8a8``: the gate_up accumulator (+ bias) and the SwiGLU stay in fp32
        and only the SwiGLU output is quantized for the down GEMM, as the fused MoE kernel does."""
        return spec.moe_experts_w8a8(x, idx, *_expert_tensors(experts), first_expert, limit, partial,
                                     weight=self._expert_weight(torch.float32), act_max=self.act_max)


def _expert_tensors(experts: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """(w13, w13_scale_inv, b13, w2, w2_scale_inv, b2) from the model's expert buffers."""
    return tuple(experts.get(n) for n in ("gate_up_proj", "gate_up_proj_scale_inv", "gate_up_proj_bias",
                                          "down_proj", "down_proj_scale_inv", "down_proj_bias"))

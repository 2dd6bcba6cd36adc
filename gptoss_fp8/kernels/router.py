"""MoE router in one kernel: logits = x @ Wr^T + br (bf16), top-k, softmax over the k selected (Triton).

gpt-oss's router (``gpt_oss/torch/model.py`` MLPBlock): ``g = gate(x)`` (a bf16 ``nn.Linear`` with
bias), ``topk(g, k, sorted=True)``, ``softmax(values)`` in bf16. Torch runs that as four kernels
(GEMM, top-k, softmax, an int64 -> int32 cast for the MoE); here one launch: the fp32 product over
H, the bias in fp32, one rounding to bf16 (the logits, written for captures), then k rounds of
(row max, lowest column holding it, mask it out) and the softmax of the k values in fp32 with one
rounding to bf16.

Two forms of the product, the same epilogue (``_route_tile``):
* tiles (``_router_kernel``): one program per BLOCK_T tokens walks all of H. Above
  ``SPLIT_MAX_TOKENS`` tokens (prefill);
* split H (``_router_split_kernel``, decode): at a few tokens the tiled form is one program walking
  H serially (45 steps of 64 at H = 2880) with most of its rows padding. Here each 16-token tile's
  H is cut into up to SPLIT ranges of whole BLOCK_K blocks, one program each; a program writes
  its fp32 partial logits to a workspace [splits, T, E] (``torch.empty`` per call) and counts its
  arrival on the tile's counter (``kernels.arrival_counters``, the split-K semaphore pattern); the
  last to arrive resets the counter to 0, sums the partials in split order 0, 1, .. (the same
  order whichever program is last: the result is deterministic) and runs the epilogue.

Numerics against ``gptoss_fp8.spec.route`` (torch on the same device), either form:
* logits: fp32 sums in another order than cuBLAS / the CPU GEMM: within one bf16 ulp (the two
  forms, in orders of their own, within one ulp of each other);
* ids: ties (equal bf16 logits) go to the lowest expert id; torch's top-k order among equal values
  is unspecified. Where two logits differ by one bf16 ulp, a one-ulp difference above can swap
  them; otherwise the same experts in the same order;
* weights: ``exp`` on the GPU is approximate: within one bf16 ulp of torch's softmax.

Layout: x bf16 [T, H] (contiguous last dim), weight bf16 [E, H] contiguous, all E experts in one
tile (BLOCK_E = next_pow2(E): meant for gpt-oss's 32 / 128); top_k <= E. No host synchronisation
(CUDA-graph capturable). The split form shares the device's counter buffer: calls on one device
must not run concurrently on several streams.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels import arrival_counters
from gptoss_fp8.kernels.pdl import launch_kwargs, pdl_wait, prefetch_l2
from gptoss_fp8.quant.fp8 import cdiv, next_pow2

SPLIT_MAX_TOKENS = 16  # router_config takes the split form up to here
SPLIT_BLOCK_T = 16  # tokens per tile of the split form: the smallest tl.dot tile


@triton.jit
def _partial_logits(
    x_ptr,
    w_ptr,
    rows64,
    row_ok,
    cols,
    col_ok,
    k_lo,
    k_hi,
    H,
    stride_x,
    stride_w,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    r_ptr=None,
    nw_ptr=None,
    NORM: tl.constexpr = False,
):
    """fp32 [BLOCK_T, BLOCK_E]: x[rows, k_lo:k_hi] @ W[cols, k_lo:k_hi]^T (k_lo a multiple of BLOCK_K). NORM: x is
    the stream before its RMSNorm and the product's rows are the norm's, bf16((x * rstd) * weight) as kernels/norm.py
    rounds them (rstd r_ptr [T] and the norm weight nw_ptr [H], float32)."""
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if NORM:
        r = tl.load(r_ptr + rows64, mask=row_ok, other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < H) | EVEN_K  # no K mask when BLOCK_K divides H: Triton then pipelines the loads
        a = tl.load(x_ptr + rows64[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # (norm.py's add_rms_norm_rows: t = x in fp32, (t * r) * w, one rounding)
            nw = tl.load(nw_ptr + offs_k, mask=offs_k < H, other=0.0)
            a = ((a.to(tl.float32) * r[:, None]) * nw[None, :]).to(x_ptr.dtype.element_ty)
        b = tl.load(w_ptr + cols[None, :] * stride_w + offs_k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 arithmetic is not the GPU's: products in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _route_tile(
    acc,
    b_ptr,
    logits_ptr,
    ids_ptr,
    wts_ptr,
    rows64,
    row_ok,
    cols,
    col_ok,
    E,
    stride_l,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The epilogue of a tile of rows: fp32 products acc [BLOCK_T, BLOCK_E] -> + bias, bf16 logits,
    top-k ids (ties to the lowest id), softmax weights; stores the three."""
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


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    logits_ptr,
    ids_ptr,
    wts_ptr,
    T,
    H,
    E,
    stride_x,
    stride_w,
    stride_l,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr = False,
    r_ptr=None,
    nw_ptr=None,
    NORM: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    rows64 = rows.to(tl.int64)
    acc = _partial_logits(
        x_ptr, w_ptr, rows64, row_ok, cols, col_ok, 0, H, H, stride_x, stride_w, BLOCK_T, BLOCK_E, BLOCK_K, UPCAST, EVEN_K,
        r_ptr, nw_ptr, NORM,
    )
    _route_tile(
        acc, b_ptr, logits_ptr, ids_ptr, wts_ptr, rows64, row_ok, cols, col_ok, E, stride_l, HAS_BIAS, TOP_K, KP, BLOCK_T, BLOCK_E
    )


@triton.jit
def _router_split_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    logits_ptr,
    ids_ptr,
    wts_ptr,
    part_ptr,
    counter_ptr,
    T,
    H,
    E,
    stride_x,
    stride_w,
    stride_l,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    CHUNK: tl.constexpr,  # H per split: whole BLOCK_K blocks
    NUM_SPLITS: tl.constexpr,  # the grid's second dimension: cdiv(H, CHUNK)
    PDL: tl.constexpr = False,
    PF_LINES: tl.constexpr = 1,  # with PDL: 64-element lines of the split's weight rows prefetched before the wait
    r_ptr=None,
    nw_ptr=None,
    NORM: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    rows64 = rows.to(tl.int64)
    k_lo = pid_s * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, H)
    if PDL:  # the router weight is the step's constant: its slice streams into L2 during the wait
        offs_l = k_lo + tl.arange(0, PF_LINES) * 64
        prefetch_l2(w_ptr + cols[:, None] * stride_w + offs_l[None, :], col_ok[:, None] & (offs_l < k_hi)[None, :])
    pdl_wait(PDL)
    acc = _partial_logits(
        x_ptr, w_ptr, rows64, row_ok, cols, col_ok, k_lo, k_hi, H, stride_x, stride_w, BLOCK_T, BLOCK_E, BLOCK_K, UPCAST, EVEN_K,
        r_ptr, nw_ptr, NORM,
    )
    # partials [NUM_SPLITS, T, E] fp32, contiguous
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(part_ptr + (pid_s * T + rows64)[:, None] * E + cols[None, :], acc, mask=tile_ok)
    # The split-K semaphore (attention_decode.py): the barrier orders every thread's partial stores
    # before the one acq_rel count, and the last program's .cg loads (L2) see all the partials.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        tl.store(counter_ptr + pid_t, 0)  # ready for the next call
        # split order 0, 1, .. whichever program is last; unrolled: the loads are independent,
        # one memory round trip for all of them
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)  # now the sum of all the partials
        for s in tl.static_range(NUM_SPLITS):
            acc += tl.load(
                part_ptr + (s * T + rows64)[:, None] * E + cols[None, :], mask=tile_ok, other=0.0, cache_modifier=".cg"
            )
        _route_tile(
            acc,
            b_ptr,
            logits_ptr,
            ids_ptr,
            wts_ptr,
            rows64,
            row_ok,
            cols,
            col_ok,
            E,
            stride_l,
            HAS_BIAS,
            TOP_K,
            KP,
            BLOCK_T,
            BLOCK_E,
        )


class RouterSplit(NamedTuple):
    """The split form's launch (module doc): H cut into at most ``splits`` ranges of whole
    ``block_k`` blocks per 16-token tile (fewer where H has fewer blocks: no empty splits)."""

    splits: int
    block_k: int
    num_warps: int
    num_stages: int


def router_config(num_tokens: int, num_experts: int, on_gpu: bool, split: bool = True) -> tuple[int, int, int] | RouterSplit:
    """The launch for ``num_tokens``: up to SPLIT_MAX_TOKENS (and ``split``) a ``RouterSplit``,
    else the tiled form's (BLOCK_T, num_warps, num_stages), tokens per program (all experts in one
    tile). ``split=False``: the tiled form's tile at any size (what every size ran before the split
    form).

    Tiles, from the H200 (CUDA-graph device time, 2880 hidden, top-4): 32 experts (64, 4, 5)
    12.8 us at 8192 tokens against 16.4 for (32, 4, 4) and 20.1 for (64, 4, 3); 128 experts
    (64, 4, 5) 20.1 us at 8192, (128, 8, 3) 62 us at 32768 against 77-80 for the 64-token tiles.
    At 1 token (64, 4, 5) took 10.6 us a call (a decode step's profile, 32 experts): one program
    walking H.

    Split (decode): RouterSplit(16, 64, 4, 3) (15 programs of 3 blocks at H = 2880). H200
    (benchmarks/router_sweep.py, CUDA graphs, "cold" = L2 flushed before each replay, thirteenth
    session): 32 experts 4.8 / 5.0 us at 1 / 16 tokens (the tiled form 10.8 / 18.5, torch 18.9 /
    21.1), within 0.3 us of the best of 36 variants; 128 experts 6.3 / 7.3 us, against 6.7 / 7.9
    for 32 splits. SPLIT_MAX_TOKENS (16) not swept. Off the GPU (the interpreter) 4 splits, so
    that the tests run the reduction over several."""
    if split and num_tokens <= SPLIT_MAX_TOKENS:
        if not on_gpu:
            return RouterSplit(4, 64, 4, 1)
        return RouterSplit(16, 64, 4, 3)
    if not on_gpu:
        return 16, 4, 1
    if num_experts > 64 and num_tokens > 16384:
        return 128, 8, 3
    return 64, 4, 5


def router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    config: tuple[int, int, int] | RouterSplit | None = None,
    pdl: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [T, H], weight bf16 [E, H], bias bf16 [E] (or None), top_k <= E ->
    (logits bf16 [T, E], ids int32 [T, k] sorted by logit, weights bf16 [T, k] = softmax over them).
    ``config``: instead of ``router_config``'s, a ``RouterSplit`` (the split form, at any T) or a
    (BLOCK_T, num_warps, num_stages) tile (the tiled form, at any T). ``pdl``: the split form
    launches with programmatic dependent launch (kernels/pdl.py; the tiled form never). ``norm`` = (rstd
    float32 [T], norm weight float32 [H]): x is the stream before its RMSNorm, whose rows (norm.py's
    bf16((x * rstd) * weight), bit for bit) are made here as the product reads them: the norm that gave rstd
    (``rms_norm_quant(rstd=)``) need not write them."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}"
    t, h = x.shape
    assert weight.dim() == 2 and weight.shape[1] == h and weight.is_contiguous(), f"router weight {tuple(weight.shape)} for H={h}"
    e = weight.shape[0]
    assert 1 <= top_k <= e, f"top_k {top_k} must be in 1..{e} experts"
    assert x.dtype == weight.dtype == torch.bfloat16, f"x {x.dtype}, weight {weight.dtype}: want bfloat16"
    if bias is not None:
        assert bias.shape == (e,) and bias.is_contiguous(), f"router bias {tuple(bias.shape)} for {e} experts"
    normed = {}
    if norm is not None:
        rstd, nw = norm
        assert rstd.shape == (t,) and rstd.dtype == torch.float32 and rstd.is_contiguous(), f"rstd {tuple(rstd.shape)}"
        assert nw.shape == (h,) and nw.dtype == torch.float32 and nw.is_contiguous(), f"norm weight {tuple(nw.shape)}"
        normed = dict(r_ptr=rstd, nw_ptr=nw, NORM=True)
    logits = torch.empty((t, e), dtype=x.dtype, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    wts = torch.empty((t, top_k), dtype=x.dtype, device=x.device)
    if t == 0:
        return logits, ids, wts
    on_gpu = x.device.type == "cuda"
    cfg = config or router_config(t, e, on_gpu)
    args = (x, weight, bias if bias is not None else weight, logits, ids, wts)
    shape = (t, h, e, x.stride(0), weight.stride(0), logits.stride(0))
    common = dict(
        HAS_BIAS=bias is not None, TOP_K=top_k, KP=max(2, next_pow2(top_k)), BLOCK_E=max(16, next_pow2(e)), UPCAST=not on_gpu
    )
    if isinstance(cfg, RouterSplit):
        blocks = cdiv(h, cfg.block_k)
        per_split = cdiv(blocks, cfg.splits)
        splits = cdiv(blocks, per_split)  # no empty splits
        tiles = cdiv(t, SPLIT_BLOCK_T)
        part = torch.empty((splits, t, e), dtype=torch.float32, device=x.device)
        _router_split_kernel[(tiles, splits)](
            *args,
            part,
            arrival_counters(x.device, tiles),
            *shape,
            **common,
            BLOCK_T=SPLIT_BLOCK_T,
            BLOCK_K=cfg.block_k,
            EVEN_K=h % cfg.block_k == 0,
            CHUNK=per_split * cfg.block_k,
            NUM_SPLITS=splits,
            PDL=pdl,
            PF_LINES=next_pow2(cdiv(per_split * cfg.block_k, 64)),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **normed,
            **launch_kwargs(pdl),
        )
        return logits, ids, wts
    assert len(cfg) == 3, f"config {cfg}: want a RouterSplit or (BLOCK_T, num_warps, num_stages)"
    block_t, warps, stages = cfg
    block_k = 64
    _router_kernel[(cdiv(t, block_t),)](
        *args,
        *shape,
        **common,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        EVEN_K=h % block_k == 0,
        num_warps=warps,
        num_stages=stages,
        **normed,
    )
    return logits, ids, wts

"""``gptoss-fp8 bench kernels --only gemm``: FP8 block GEMM + bias and the fused FP8 MoE FFN.

Peers, measured in the same run on the same inputs (median of ``triton.testing.do_bench``):
- dense: cuBLAS blockwise ``torch._scaled_mm`` without bias (x scales 1x128 [M, K/128]
  column-major, weight scales 128x128 [N/128, K/128] transposed; K padded to a multiple of 512:
  with 23 K blocks it gives wrong values or refuses, ``cublas_blockwise``): an unfused
  ``out += bias`` would understate it by ~25%. Ours includes the bias in the kernel; both start
  from already-quantized activations.
- MoE FFN (route + sort + both grouped GEMMs + SwiGLU + weighted combine, everything from bf16 x
  to bf16 out): ours (FP8, activation quantization included) against the same FFN in bf16 with
  ``torch._grouped_mm``.
- DeepGEMM, when ``deep_gemm`` is importable (kernels/deepgemm.py; BENCHMARKS.md "How to run the
  peers"): its dense GEMM (no bias, K-padded operands prepared beforehand) beside ours; its two
  grouped GEMMs alone (gate_up + down, no bias, no SwiGLU, rows already grouped) beside our whole
  expert FFN ``moe_experts`` (quantization, alignment, both GEMMs with bias and SwiGLU, combine);
  and our ``deep_gemm`` backend (the same calls with our glue: activation re-layout, bias, SwiGLU,
  quantization, scatter, combine) beside DeepGEMM alone: rows "[deep_gemm backend]".
FLOPs: dense 2*M*N*K; MoE 2*T*top_k*(H*2I + I*H) (router and elementwise work not counted; the
real, unpadded K for DeepGEMM too).

``python -m gptoss_fp8.bench.kernels_gemm --sweep`` times tile configurations (used to pick the
defaults of KernelConfig.dense_tile and KernelConfig.moe_plan, kernels/config.py).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from gptoss_fp8 import spec
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.config import DEFAULT, GluonTile, MoePlan, TritonTile
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm
from gptoss_fp8.kernels.moe import fused_moe, moe_align, moe_experts
from gptoss_fp8.quant.fp8 import BLOCK, FP8_DTYPE, cdiv, quantize_act, quantize_weight_blocks

HIDDEN = 2880
INTER = 2880
TOP_K = 4
# (name, N, K): gpt-oss dense projections (qkv fused, o) and an expert-sized dense GEMM.
DENSE_SHAPES = [("qkv 5120x2880", 5120, 2880), ("o 2880x4096", 2880, 4096), ("5760x2880", 5760, 2880)]
MOE_EXPERTS = [32, 128]


def _warm(fn) -> None:
    # Compile, load and run once outside the timing: without this the first case measured in a
    # process read up to 2x slow on the H200 (0.100 ms vs 0.052 ms, qkv M=1024).
    fn()
    fn()
    torch.cuda.synchronize()


def _ms(fn) -> float:
    _warm(fn)
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _ms_graph(fn) -> float:
    _warm(fn)
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else float("nan")


def _row(case, flops, ms, peer, peer_ms) -> dict:
    tf, ptf = _tflops(flops, ms), _tflops(flops, peer_ms)
    return dict(case=case, ms=ms, tflops=tf, peer=peer, peer_ms=peer_ms, peer_tflops=ptf,
                ratio=peer_ms / ms if math.isfinite(peer_ms) else float("nan"))


# ------------------------------------------------------------------------------------------------
# Dense
# ------------------------------------------------------------------------------------------------


def pad_k(t: torch.Tensor, multiple: int = BLOCK) -> torch.Tensor:
    """A [..., K] tensor (fp8 or float) zero-padded along K to a multiple of ``multiple`` (itself
    when K is one already)."""
    k = t.shape[-1]
    kp = cdiv(k, multiple) * multiple
    if kp == k:
        return t
    if t.dtype == FP8_DTYPE:  # no pad kernel for fp8: pad the bytes
        return torch.nn.functional.pad(t.view(torch.uint8), (0, kp - k)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, kp - k))


def rel_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||y - ref|| / ||ref||, max |y - ref| / max |ref|) in float32; inf where y has NaNs (unwritten
    outputs of a NaN-poisoned buffer): the sweeps' check of a variant before it is timed."""
    y, ref = y.float(), ref.float()
    if torch.isnan(y).any():
        return float("inf"), float("inf")
    d = y - ref
    return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()


# cuBLAS's blockwise scaling takes K in whole groups of 4 scale blocks (512): see cublas_blockwise
CUBLAS_K_MULTIPLE = 4 * BLOCK


def cublas_blockwise(x_fp8, x_scale, w_fp8, w_scale):
    """torch blockwise FP8 GEMM (cuBLAS), no bias: a callable computing bf16 x @ W^T, as a user
    must call it for gpt-oss. K is zero-padded to a multiple of 512 and both scale tensors with
    zero columns to match (the result is the same; cuBLAS multiplies 3072 for K = 2880, 6.7% more
    than our kernels, which take 2880 as it is). Fourteenth session, H200, torch 2.11
    (benchmarks/cublas_layout_probe.py, against the fp32 reference): with K padded only to the 128
    grid (23 K blocks) ``_scaled_mm`` accepts the call and returns wrong values (rel. err. 2.4 to
    1100), and weight scales whose leading dimension is padded to 24 are refused ("Invalid scaling
    configuration"); K = 4096 (32 blocks) needs no padding. x scales 1x128 [M, K/128] column-major,
    weight scales 128x128 [K/128, N/128] (the transposed [N/128, K/128])."""
    k = x_fp8.shape[-1]
    kp = cdiv(k, CUBLAS_K_MULTIPLE) * CUBLAS_K_MULTIPLE
    kb = kp // BLOCK
    xs = torch.nn.functional.pad(x_scale, (0, kb - x_scale.shape[-1]))
    ws = torch.nn.functional.pad(w_scale, (0, kb - w_scale.shape[-1]))
    a_scale = xs.t().contiguous().t()  # [M, K/128] column-major
    b = pad_k(w_fp8, CUBLAS_K_MULTIPLE).t()  # [K, N] column-major
    b_scale = ws.t()  # [K/128, N/128]
    xp = pad_k(x_fp8, CUBLAS_K_MULTIPLE)
    return lambda: torch._scaled_mm(xp, b, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def _dense_peer(x_fp8, x_scale, w_fp8, w_scale, bias=None):
    """(callable peer GEMM (+ bias add when given), note): ``cublas_blockwise``."""
    mm = cublas_blockwise(x_fp8, x_scale, w_fp8, w_scale)
    mm()
    k = x_fp8.shape[-1]
    kp = cdiv(k, CUBLAS_K_MULTIPLE) * CUBLAS_K_MULTIPLE
    note = "" if kp == k else f" (K padded to {kp})"

    def peer():
        y = mm()
        if bias is not None:
            y += bias
        return y

    return peer, note


def _dense_weights(n: int, k: int, g: torch.Generator, bias_std: float = 1.0):
    """Random block-quantized weight [n, k] (fp8 + scale_inv) and a bf16 bias [n]."""
    w_fp8, w_scale = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    bias = (torch.randn(n, device="cuda", generator=g) * bias_std).to(torch.bfloat16)
    return w_fp8, w_scale, bias


def bench_dense(tokens: list[int], with_deepgemm: bool = False, config=None) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in DENSE_SHAPES:
        w_fp8, w_scale, bias = _dense_weights(n, k, g, bias_std=0.5)
        for m in tokens:
            x_fp8, x_scale = quantize_act(torch.randn(m, k, device="cuda", generator=g))
            flops = 2.0 * m * n * k
            ours = lambda a=(x_fp8, x_scale, w_fp8, w_scale, bias): fp8_gemm(*a, config=config)  # noqa: E731
            ms = _ms(ours)
            try:
                peer, note = _dense_peer(x_fp8, x_scale, w_fp8, w_scale)
                peer_ms = _ms(peer)
            except RuntimeError as err:  # the peer's failure is a result to print, not a crash
                note, peer_ms = f" (failed: {str(err).splitlines()[0][:80]})", float("nan")
            row = _row(f"dense+bias {name} M={m}", flops, ms, "cuBLAS _scaled_mm blockwise, no bias" + note, peer_ms)
            # device time alone (CUDA-graph replay): below ~4096 rows a plain call is host-bound
            row["graph_ms"] = _ms_graph(ours)
            row["peer_graph_ms"] = _ms_graph(peer) if math.isfinite(peer_ms) else float("nan")
            row["graph_ratio"] = row["peer_graph_ms"] / row["graph_ms"]
            rows.append(row)
            if with_deepgemm:
                rows += _dense_deepgemm_rows(f"dense+bias {name} M={m}", flops, ms, x_fp8, x_scale, w_fp8, w_scale, bias)
            del x_fp8, x_scale
    return rows


def _dense_deepgemm_rows(case, flops, ours_ms, x_fp8, x_scale, w_fp8, w_scale, bias) -> list[dict]:
    """DeepGEMM's dense GEMM alone (operands K-padded and scales laid out beforehand, no bias) beside
    ours, and our deep_gemm backend (``deepgemm.linear`` from the same unpadded quantization, as the
    model hands it the norm's: re-layout + GEMM + bias) beside DeepGEMM alone."""
    from gptoss_fp8.kernels import deepgemm

    xa, xs = deepgemm.padded_quant(None, (x_fp8, x_scale))
    wp, sp = deepgemm.prepared_weight(w_fp8, w_scale)
    out = torch.empty((x_fp8.shape[0], w_fp8.shape[0]), dtype=torch.bfloat16, device=x_fp8.device)
    dense = getattr(deepgemm.require(), deepgemm.DENSE_API)
    dg_ms = _ms(lambda: dense((xa, xs), (wp, sp), out))
    backend_ms = _ms(lambda: deepgemm.linear(None, w_fp8, w_scale, bias, xq=(x_fp8, x_scale)))
    return [_row(case, flops, ours_ms, "DeepGEMM gemm_fp8_fp8_bf16_nt, no bias", dg_ms),
            _row(case + " [deep_gemm backend]", flops, backend_ms, "DeepGEMM gemm_fp8_fp8_bf16_nt, no bias", dg_ms)]


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------


def _moe_weights(e: int, g: torch.Generator):
    w13 = torch.randn(e, 2 * INTER, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16) / HIDDEN**0.5
    w2 = torch.randn(e, HIDDEN, INTER, device="cuda", generator=g, dtype=torch.bfloat16) / INTER**0.5
    b13 = (torch.randn(e, 2 * INTER, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    b2 = (torch.randn(e, HIDDEN, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    wr = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    br = (torch.randn(e, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    return w13, b13, w2, b2, wr, br


def route(x, wr, br, top_k):
    """The torch router (``spec.route``): (weights bf16 [T, k], ids int32 [T, k])."""
    _, ids, w = spec.route(x, wr, br, top_k)
    return w, ids.to(torch.int32)


def _moe_fp8_weights(e: int, g: torch.Generator):
    """``_moe_weights`` with the expert matrices block-quantized (the bf16 ones freed):
    (w13_fp8, s13, b13, w2_fp8, s2, b2, wr, br)."""
    w13, b13, w2, b2, wr, br = _moe_weights(e, g)
    w13_fp8, s13 = quantize_weight_blocks(w13)
    del w13
    w2_fp8, s2 = quantize_weight_blocks(w2)
    return w13_fp8, s13, b13, w2_fp8, s2, b2, wr, br


def moe_bf16_grouped_mm(x, wr, br, w13, b13, w2, b2, top_k: int) -> torch.Tensor:
    """The peer: the gpt-oss expert FFN in bf16 with torch._grouped_mm (same routing)."""
    t, h = x.shape
    e = w13.shape[0]
    weights, ids = route(x, wr, br, top_k)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, sorted_e, torch.ones_like(sorted_e, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // top_k
    hg = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs) + b13[sorted_e]
    a = spec.swiglu(hg)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs) + b2[sorted_e]
    y = y * weights.reshape(-1)[order, None]
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def bench_moe(tokens: list[int], experts: list[int] = MOE_EXPERTS, with_deepgemm: bool = False,
              config=None) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for e in experts:
        w13, b13, w2, b2, wr, br = _moe_weights(e, g)
        w13_fp8, s13 = quantize_weight_blocks(w13)
        w2_fp8, s2 = quantize_weight_blocks(w2)
        for t in tokens:
            x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            flops = 2.0 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
            ours = lambda a=(x, wr, br, w13_fp8, s13, b13, w2_fp8, s2, b2): fused_moe(*a, top_k=TOP_K, config=config)  # noqa: E731
            peer = lambda a=(x, wr, br, w13, b13, w2, b2): moe_bf16_grouped_mm(*a, TOP_K)  # noqa: E731
            ms = _ms(ours)
            try:
                peer_ms = _ms(peer)
                note = ""
            except RuntimeError as err:
                peer_ms, note = float("nan"), f" (failed: {str(err).splitlines()[0][:80]})"
            rows.append(_row(f"moe ffn E={e} top{TOP_K} T={t}", flops, ms, "bf16 _grouped_mm ffn" + note, peer_ms))
            if with_deepgemm:
                rows += _moe_deepgemm_rows(e, t, flops, x, wr, br, (w13_fp8, s13, b13, w2_fp8, s2, b2), config)
        del w13, w2, w13_fp8, w2_fp8
        if with_deepgemm:
            from gptoss_fp8.kernels import deepgemm

            deepgemm.clear_cache()  # the K-padded expert copies
        torch.cuda.empty_cache()
    return rows


def _moe_deepgemm_rows(e, t, flops, x, wr, br, experts, config=None) -> list[dict]:
    """DeepGEMM's two grouped GEMMs alone (rows grouped and padded to 128, A and the intermediate
    prepared beforehand from the same routing, no bias) beside our whole expert FFN after routing
    (``moe_experts``), and our deep_gemm backend's expert FFN + combine beside the same two GEMMs."""
    from gptoss_fp8.kernels import deepgemm
    from gptoss_fp8.kernels.moe import moe_combine
    from gptoss_fp8.kernels.swiglu_quant import swiglu_quant

    w13, s13, b13, w2, s2, b2 = experts
    weights, ids = route(x, wr, br, TOP_K)
    ours_ms = _ms(lambda: moe_experts(x, weights, ids, *experts, config=config))
    slots, block_expert = moe_align(ids, 0, e, deepgemm.ALIGN_M)
    a, a_s, m_indices = deepgemm.gather_rows(*act_quant(x), slots, block_expert, TOP_K, e)
    w13p, s13p = deepgemm.prepared_weight(w13, s13)
    w2p, s2p = deepgemm.prepared_weight(w2, s2)
    grouped = getattr(deepgemm.require(), deepgemm.GROUPED_API)
    gu_out = torch.empty((a.shape[0], w13.shape[1]), dtype=torch.bfloat16, device=x.device)
    gu_ms = _ms(lambda: grouped((a, a_s), (w13p, s13p), gu_out, m_indices))
    act, act_s = swiglu_quant(gu_out, b13, m_indices)
    dn_out = torch.empty((a.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=x.device)
    dn_ms = _ms(lambda: grouped((act, act_s), (w2p, s2p), dn_out, m_indices))

    def backend():
        y = deepgemm.expert_slots(x, ids, *experts)
        return moe_combine(y, weights, ids, 0, e)

    backend_ms = _ms(backend)
    real = t * TOP_K
    extra = dict(deepgemm_gate_up_ms=gu_ms, deepgemm_down_ms=dn_ms,
                 deepgemm_gate_up_tflops=_tflops(2.0 * real * 2 * INTER * HIDDEN, gu_ms),
                 deepgemm_down_tflops=_tflops(2.0 * real * HIDDEN * INTER, dn_ms))
    peer = "DeepGEMM grouped gate_up + down alone, no bias"
    case = f"moe experts E={e} top{TOP_K} T={t}"
    return [_row(case, flops, ours_ms, peer, gu_ms + dn_ms) | extra,
            _row(case + " [deep_gemm backend]", flops, backend_ms, peer, gu_ms + dn_ms) | extra]


def bench_router(tokens: list[int], experts: list[int] = MOE_EXPERTS) -> list[dict]:
    """The router kernel (GEMM + bias + top-k + softmax, int32 ids) against torch's ``route`` (bf16
    linear, topk, softmax, int32 cast: what the model ran before), plain and CUDA-graph timed."""
    from gptoss_fp8.kernels.router import router

    rows = []
    g = torch.Generator(device="cuda").manual_seed(2)
    for e in experts:
        wr = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(torch.bfloat16)
        br = (0.1 * torch.randn(e, device="cuda", generator=g)).to(torch.bfloat16)
        for t in tokens:
            x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            ours = lambda: router(x, wr, br, TOP_K)  # noqa: E731
            peer = lambda: route(x, wr, br, TOP_K)  # noqa: E731
            row = _row(f"router E={e} top{TOP_K} T={t}", 2.0 * t * HIDDEN * e, _ms(ours),
                       "torch route (linear+topk+softmax)", _ms(peer))
            row.update(graph_ms=_ms_graph(ours), peer_graph_ms=_ms_graph(peer))
            row["graph_ratio"] = row["peer_graph_ms"] / row["graph_ms"]
            # device time of other tiles (BLOCK_T, warps, stages), for the next choice of router_config
            row["configs_graph_ms"] = {str(c): _ms_graph(lambda c=c: router(x, wr, br, TOP_K, config=c))
                                       for c in ((32, 4, 4), (64, 4, 3), (64, 4, 5), (16, 4, 4), (128, 8, 3))}
            rows.append(row)
    return rows


def bench(tokens: list[int], gemm: str = "ours", config=None) -> list[dict]:
    """Rows {case, ms, tflops, peer, peer_ms, peer_tflops, ratio (peer_ms / ms; > 1: ours faster)};
    dense and router rows also graph_ms, peer_graph_ms and graph_ratio (CUDA-graph replay: device
    time only). DeepGEMM rows when deep_gemm is importable; ``gemm="deep_gemm"``: they are required
    (GptOssFp8Error, one line, when it is not importable). ``config``: our dense GEMM's and MoE's
    ``KernelConfig`` (None: the default; ``bench kernels --kernel-option``)."""
    from gptoss_fp8.kernels import deepgemm

    if gemm == "deep_gemm":
        deepgemm.require()
    with_dg = deepgemm.available()
    if not with_dg:
        print(f"# DeepGEMM rows skipped: deep_gemm is not importable ({deepgemm._load()[1]})")
    return (bench_dense(tokens, with_dg, config) + bench_moe(tokens, with_deepgemm=with_dg, config=config)
            + bench_router(tokens))


# ------------------------------------------------------------------------------------------------
# Tile sweep
# ------------------------------------------------------------------------------------------------

DENSE_SWEEP = [  # 128-wide tiles only: 256-wide ones ran at 0.70-0.92x (notes/kernels_gemm.md) and were removed
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=4),
    TritonTile(128, 128, group_m=8, num_warps=4, num_stages=4),
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=3, persistent=1, flatten=True),
    TritonTile(64, 128, group_m=8, num_warps=4, num_stages=5),
    TritonTile(64, 128, group_m=8, num_warps=4, num_stages=4, persistent=2, flatten=True),
    TritonTile(64, 128, group_m=16, num_warps=4, num_stages=4),
    TritonTile(128, 64, group_m=8, num_warps=4, num_stages=4),
]


def _moe_sweep_configs() -> list[MoePlan]:
    gu64 = TritonTile(64, 256, group_m=8, num_warps=8, num_stages=4, split_n=False)
    gu64s3 = TritonTile(64, 256, group_m=8, num_warps=8, num_stages=3, split_n=False)
    gu64split = TritonTile(64, 256, group_m=8, num_warps=8, num_stages=4)
    gu128 = TritonTile(128, 256, group_m=8, num_warps=8, num_stages=3, split_n=False)
    dn64 = TritonTile(64, 128, group_m=8, num_warps=4, num_stages=4)
    dn128 = TritonTile(128, 128, group_m=8, num_warps=8, num_stages=4)
    return [
        MoePlan(64, gu64, dn64),
        MoePlan(64, gu64s3, dn64),
        MoePlan(64, gu64split, dn64),
        MoePlan(64, gu64, dn64, tma=False),
        MoePlan(128, gu64, dn128),
        MoePlan(128, gu128, dn128),
        MoePlan(128, gu64, dn64),
    ]


def _ms_quick(fn) -> float:
    _warm(fn)
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def kernel_resources() -> list[str]:
    """Registers / spills of every compiled variant of our GEMM kernels (from Triton's cache)."""
    from gptoss_fp8.kernels import fp8_gemm as dense_mod
    from gptoss_fp8.kernels import moe_gemm

    lines = []
    for kern in (dense_mod._fp8_gemm_kernel, moe_gemm._moe_gemm_kernel):
        for dev_cache in getattr(kern, "device_caches", {}).values():
            for key, ck in dev_cache[0].items():
                md = ck.metadata
                lines.append(f"{kern.fn.__name__} regs={ck.n_regs} spills={ck.n_spills} warps={md.num_warps} "
                             f"stages={md.num_stages} shared={md.shared} key={str(key)[-260:]}")
    return lines


def sweep(tokens: list[int], moe_tokens: tuple[int, ...] | list[int] = (8192,)) -> list[dict]:
    """Time each dense and MoE tile configuration; rows {case, config, ms, tflops}."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(2)
    for name, n, k in DENSE_SHAPES:
        w_fp8, w_scale, bias = _dense_weights(n, k, g)
        for m in tokens:
            x_fp8, x_scale = quantize_act(torch.randn(m, k, device="cuda", generator=g))
            for cfg in DENSE_SWEEP + [DEFAULT.dense_tile(m, n, k)]:
                try:
                    ms = _ms_quick(lambda: fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, tile=cfg))
                except Exception as err:  # noqa: BLE001 - a config that does not compile is a data point
                    ms = float("nan")
                    print("config failed", cfg, str(err).splitlines()[:1])
                rows.append(dict(case=f"dense {name} M={m}", config=repr(cfg), ms=ms, tflops=_tflops(2.0 * m * n * k, ms)))
                print(rows[-1], flush=True)
    for e in MOE_EXPERTS:
        w13_fp8, s13, b13, w2_fp8, s2, b2, wr, br = _moe_fp8_weights(e, g)
        for t in moe_tokens:
            x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            # Where the time goes with the default configuration (the GEMMs are the remainder).
            w, ids = route(x, wr, br, TOP_K)
            base = DEFAULT.moe_plan(t, TOP_K, e)
            parts = {
                "route": lambda: route(x, wr, br, TOP_K),
                "align": lambda: moe_align(ids, 0, e, base.align_m),
                "act_quant": lambda: act_quant(x),
                "experts (quant+align+2 GEMMs+combine)": lambda a=(x, w, ids, w13_fp8, s13, b13, w2_fp8, s2, b2): moe_experts(*a),
            }
            for name, fn in parts.items():
                rows.append(dict(case=f"moe E={e} T={t} part", config=name, ms=_ms_quick(fn), tflops=float("nan")))
                print(rows[-1], flush=True)
            cfgs = [DEFAULT.moe_plan(t, TOP_K, e)] + _moe_sweep_configs()
            flops = 2.0 * t * TOP_K * 3 * HIDDEN * INTER
            for cfg in cfgs:
                try:
                    ms = _ms_quick(lambda a=(x, wr, br, w13_fp8, s13, b13, w2_fp8, s2, b2): _moe_plan_call(a, cfg))
                except Exception as err:  # noqa: BLE001
                    ms = float("nan")
                    print("config failed", cfg, str(err).splitlines()[:1])
                rows.append(dict(case=f"moe E={e} T={t}", config=repr(cfg), ms=ms, tflops=_tflops(flops, ms)))
                print(rows[-1], flush=True)
        del w13_fp8, w2_fp8
        torch.cuda.empty_cache()
    return rows


def _moe_plan_call(a, plan: MoePlan):
    """fused_moe of the arguments a = (x, wr, br, w13, s13, b13, w2, s2, b2) with this plan."""
    x, wr, br, *ex = a
    w, ids = route(x, wr, br, TOP_K)
    return moe_experts(x, w, ids, *ex, plan=plan)


def _moe_variant_configs(t: int, e: int) -> dict[str, MoePlan]:
    """The Triton kernels' plan ("triton", the reference of the comparison) and the Gluon
    warp-specialized gate_up (kernels/moe_ws.py) with its ring depth / tile order, where it applies."""
    out = {"triton": DEFAULT.moe_plan(t, TOP_K, e)}
    ws = DEFAULT.moe_plan(t, TOP_K, e, gluon_ok=True)
    if isinstance(ws.gate_up, GluonTile):
        out["WS gate_up (default)"] = ws
        for stages, group in [(3, 8), (5, 8), (4, 4), (4, 16)]:
            out[f"WS gate_up {stages} stages, GROUP_M {group}"] = MoePlan(ws.align_m, GluonTile(stages, group), ws.down)
    return out


def moe_variants(moe_tokens: list[int], only: str = "") -> list[dict]:
    """The whole fused MoE FFN with each variant of ``_moe_variant_configs``, two interleaved passes
    (a change that wins both is not clock drift), and the largest difference from the default output."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(4)
    for e in MOE_EXPERTS:
        w13_fp8, s13, b13, w2_fp8, s2, b2, wr, br = _moe_fp8_weights(e, g)
        for t in moe_tokens:
            x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            flops = 2.0 * t * TOP_K * 3 * HIDDEN * INTER
            variants = _moe_variant_configs(t, e)
            if only:  # the reference ("triton") and the variants whose names contain one of these
                keep = only.split(",")
                variants = {n: c for n, c in variants.items() if n == "triton" or any(k in n for k in keep)}
            run = {n: (lambda c=c, a=(x, wr, br, w13_fp8, s13, b13, w2_fp8, s2, b2): _moe_plan_call(a, c))
                   for n, c in variants.items()}
            ref = run["triton"]().float()
            for rep in range(2):
                for name, fn in run.items():
                    ms = _ms_quick(fn)
                    diff = ((fn().float() - ref).norm() / ref.norm()).item()
                    rows.append(dict(case=f"moe E={e} T={t}", config=name, rep=rep, ms=ms, tflops=_tflops(flops, ms),
                                     rel_vs_triton=diff))
                    print(rows[-1], flush=True)
        del w13_fp8, w2_fp8
        torch.cuda.empty_cache()
    return rows


PROBE_CONFIGS = [
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=4),
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=3, persistent=1, flatten=True),
    TritonTile(64, 128, group_m=8, num_warps=4, num_stages=4, persistent=2, flatten=True),
    TritonTile(64, 128, group_m=8, num_warps=4, num_stages=5, persistent=2, flatten=True),
    GluonTile(stages=4, group_m=8),  # the Gluon warp-specialized kernel (kernels/fp8_gemm_ws.py)
    GluonTile(stages=5, group_m=8),
    GluonTile(stages=4, group_m=16),
]


def probe(tokens: list[int]) -> list[dict]:
    """Small-M check: each config timed twice, alternating, with plain launches (host overhead
    included, as ``bench``) and with CUDA-graph replay (device time only); the peer likewise."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(3)
    for name, n, k in DENSE_SHAPES:
        w_fp8, w_scale, bias = _dense_weights(n, k, g)
        for m in tokens:
            x_fp8, x_scale = quantize_act(torch.randn(m, k, device="cuda", generator=g))
            fns = {repr(c): (lambda c=c: fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, tile=c)) for c in PROBE_CONFIGS}
            fns["peer"] = _dense_peer(x_fp8, x_scale, w_fp8, w_scale, bias)[0]
            for rep in range(2):
                for label, fn in fns.items():
                    plain = _ms(fn)
                    graph = _ms_graph(fn)
                    rows.append(dict(case=f"probe {name} M={m} rep{rep}", config=label, ms=plain, graph_ms=graph,
                                     tflops=_tflops(2.0 * m * n * k, plain), graph_tflops=_tflops(2.0 * m * n * k, graph)))
                    print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--moe-tokens", default="8192", help="token counts of the MoE sweep")
    p.add_argument("--sweep", action="store_true", help="time tile configurations instead of the peer comparison")
    p.add_argument("--probe", action="store_true", help="small-M timing check: plain launches vs CUDA graphs")
    p.add_argument("--moe-variants", action="store_true", help="the default MoE config against single changes")
    p.add_argument("--only", default="", help="--moe-variants: only variants whose names contain one of these (comma-separated)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",") if t]
    if a.moe_variants:
        rows = moe_variants([int(t) for t in a.moe_tokens.split(",") if t], a.only)
    elif a.probe:
        rows = probe(tokens)
    elif a.sweep:
        rows = sweep(tokens, [int(t) for t in a.moe_tokens.split(",") if t])
    else:
        rows = bench(tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    if a.sweep:
        print("\n".join(kernel_resources()))
        best: dict[str, dict] = {}
        for r in rows:
            if r["ms"] == r["ms"] and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
                best[r["case"]] = r
        print("best per case:")
        for r in best.values():
            print(f"  {r['case']}: {r['ms']:.4f} ms {r['tflops']:.0f} TFLOP/s {r['config']}")


if __name__ == "__main__":
    main()

"""DeepGEMM side by side with our kernels, one process, the same shapes (BENCHMARKS.md, "Peers").

DeepGEMM (deepseek-ai/DeepGEMM 03d0be3, packed in .peers/) is the strongest FP8 block-scaled GEMM
we know of on Hopper. It has no bias, no SwiGLU and needs K % 128 == 0, so K = 2880 is zero-padded
to 2944 on its side; TFLOP/s count the real, unpadded K for both. Cases:

- MoE: DeepGEMM's two grouped GEMMs (gate_up [M, 2944] x [E, 5760, 2944], down [M, 2944] x
  [E, 2880, 2944], each expert's rows padded to its alignment) against our whole expert FFN
  ``moe_experts`` (activation quantization, gate_up + bias + SwiGLU, down + bias, weighted combine)
  on the same routing: 32 / 128 experts, top-4, 8192 / 32768 tokens.
- dense: DeepGEMM ``gemm_fp8_fp8_bf16_nt`` (no bias) and cuBLAS blockwise ``torch._scaled_mm`` (no
  bias) against our ``fp8_gemm`` + bias, at the qkv, o_proj and 5760x2880 shapes.

Times: median of ``triton.testing.do_bench`` (ms). Usage on the GPU machine, .peers/ carried:

    source .peers/deepgemm_setup.sh .peers/deepgemm-03d0be3.tgz && python3 benchmarks/deepgemm_peer.py [--json FILE]

``--back-to-back {deepgemm,ours} --seconds S`` (issue 34: the prefill's MoE runs at the 700 W cap) instead
launches one side's MoE GEMMs at 32 experts, 32768 tokens back to back for S seconds: DeepGEMM's two grouped
GEMMs, or our ``moe_expert_slots`` (row gather, gate_up + bias + SwiGLU, down + bias). Under
benchmarks/clock_watch.py it shows the clock each holds at the cap, so energy a FLOP can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import cuda.bindings.nvrtc  # noqa: F401  (DeepGEMM's tests import NVRTC before torch)
import torch
from triton.testing import do_bench

sys.path.insert(0, os.environ["DG_TESTS"])  # set by deepgemm_setup.sh
import deep_gemm  # noqa: E402
from deep_gemm.jit_kernels.utils import get_m_alignment_for_contiguous_layout  # noqa: E402
from test_core import per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: E402  (DeepGEMM's own casts)

from gptoss_fp8.bench.kernels_gemm import cublas_blockwise  # noqa: E402
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm  # noqa: E402
from gptoss_fp8.kernels.moe import moe_experts  # noqa: E402
from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks  # noqa: E402

HIDDEN, INTER, TOP_K = 2880, 2880, 4
DENSE = [("qkv", 8192, 5120, 2880), ("o_proj", 8192, 2880, 4096), ("5760x2880", 8192, 5760, 2880),
         ("qkv", 32768, 5120, 2880)]
MOE = [(32, 8192), (128, 8192), (32, 32768), (128, 32768)]


def _ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _pad_k(w: torch.Tensor) -> torch.Tensor:
    """Zero-pad the last (K) dim to a multiple of 128, as DeepGEMM requires."""
    k = w.shape[-1]
    return torch.nn.functional.pad(w, (0, (k + 127) // 128 * 128 - k))


def _grouped_weights(e: int, n: int, g: torch.Generator):
    """DeepGEMM's operand: [E, n, 2944] fp8 with [E, n/128, 2944/128] scales, from a bf16 [E, n, 2880]."""
    w = _pad_k(torch.randn(e, n, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16) / HIDDEN**0.5)
    w_fp8 = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    w_s = torch.empty(e, (n + 127) // 128, w.shape[-1] // 128, device="cuda", dtype=torch.float32)
    for i in range(e):
        w_fp8[i], w_s[i] = per_block_cast_to_fp8(w[i])
    return w_fp8, w_s


def moe_rows(e: int, t: int, g: torch.Generator) -> dict:
    # Routing: random router logits, top-4 per token (the same ids for both sides).
    logits = torch.randn(t, e, device="cuda", generator=g)
    topk_w, topk_ids = torch.topk(logits, TOP_K, dim=1)
    topk_w, topk_ids = torch.softmax(topk_w, dim=1).to(torch.bfloat16), topk_ids.to(torch.int32)
    x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    flops = 2.0 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)

    # Ours: the whole expert FFN.
    w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5)
    w2, s2 = quantize_weight_blocks(torch.randn(e, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5)
    b13 = (0.3 * torch.randn(e, 2 * INTER, device="cuda", generator=g)).to(torch.bfloat16)
    b2 = (0.1 * torch.randn(e, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    ours_ms = _ms(lambda w=(w13, s13, b13, w2, s2, b2): moe_experts(x, topk_w, topk_ids, *w))
    del w13, s13, w2, s2
    torch.cuda.empty_cache()

    # DeepGEMM: rows grouped by expert, each expert's segment padded to the alignment (-1 rows).
    align = get_m_alignment_for_contiguous_layout()
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=e).tolist()
    padded = [(c + align - 1) // align * align for c in counts]
    m = sum(padded)
    m_indices = torch.full((m,), -1, device="cuda", dtype=torch.int32)
    start = 0
    for i, (c, p) in enumerate(zip(counts, padded, strict=True)):
        m_indices[start:start + c] = i
        start += p
    a = per_token_cast_to_fp8(_pad_k(torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)))
    a = (a[0], deep_gemm.get_col_major_tma_aligned_tensor(a[1]))
    gu = _grouped_weights(e, 2 * INTER, g)
    gu_out = torch.empty(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    gu_ms = _ms(lambda w=gu: deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(a, w, gu_out, m_indices))
    del gu
    torch.cuda.empty_cache()
    dn = _grouped_weights(e, HIDDEN, g)
    dn_out = torch.empty(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dn_ms = _ms(lambda w=dn: deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(a, w, dn_out, m_indices))
    del dn
    torch.cuda.empty_cache()
    real = t * TOP_K
    return dict(case=f"moe E={e} top{TOP_K} T={t}", deepgemm_gate_up_ms=gu_ms, deepgemm_down_ms=dn_ms,
                deepgemm_gate_up_tflops=_tflops(2.0 * real * 2 * INTER * HIDDEN, gu_ms),
                deepgemm_down_tflops=_tflops(2.0 * real * HIDDEN * INTER, dn_ms),
                deepgemm_two_gemms_ms=gu_ms + dn_ms, ours_moe_experts_ms=ours_ms,
                ours_tflops=_tflops(flops, ours_ms), time_ratio=ours_ms / (gu_ms + dn_ms))


def dense_row(name: str, m: int, n: int, k: int, g: torch.Generator) -> dict:
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    bias = (0.5 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    x_fp8, x_s = quantize_act(x)
    w_fp8, w_s = quantize_weight_blocks(w)
    ours_ms = _ms(lambda: fp8_gemm(x_fp8, x_s, w_fp8, w_s, bias))
    # cuBLAS blockwise, no bias, K padded to the 128 grid (the unpadded K = 2880 gives wrong values)
    cublas_ms = _ms(cublas_blockwise(x_fp8, x_s, w_fp8, w_s))
    dx = per_token_cast_to_fp8(_pad_k(x.bfloat16()))
    dx = (dx[0], deep_gemm.get_col_major_tma_aligned_tensor(dx[1]))
    dw = per_block_cast_to_fp8(_pad_k(w.bfloat16()))
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    dg_ms = _ms(lambda: deep_gemm.gemm_fp8_fp8_bf16_nt(dx, dw, out))
    flops = 2.0 * m * n * k
    return dict(case=f"dense {name} {m}x{n}x{k}", ours_gemm_bias_ms=ours_ms, ours_tflops=_tflops(flops, ours_ms),
                cublas_no_bias_ms=cublas_ms, cublas_tflops=_tflops(flops, cublas_ms),
                deepgemm_no_bias_ms=dg_ms, deepgemm_tflops=_tflops(flops, dg_ms),
                time_ratio_vs_deepgemm=ours_ms / dg_ms, time_ratio_vs_cublas=ours_ms / cublas_ms)


def moe_back_to_back(who: str, e: int, t: int, seconds: float, g: torch.Generator) -> None:
    """One side's MoE GEMMs at (e experts, t tokens) launched back to back for ``seconds`` (module docstring);
    prints the burst median, the back-to-back time a launch and both as TFLOP/s."""
    from clock_watch import back_to_back

    from gptoss_fp8 import spec
    from gptoss_fp8.kernels.act_quant import act_quant
    from gptoss_fp8.kernels.moe import moe_expert_slots

    x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    wr = (torch.randn(e, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    _, ids, _ = spec.route(x, wr, torch.zeros(e, device="cuda", dtype=torch.bfloat16), TOP_K)
    ids = ids.to(torch.int32)
    if who == "ours":
        w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5)
        w2, s2 = quantize_weight_blocks(torch.randn(e, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5)
        b13 = (0.3 * torch.randn(e, 2 * INTER, device="cuda", generator=g)).to(torch.bfloat16)
        b2 = (0.1 * torch.randn(e, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
        xq = act_quant(x)

        def run():
            moe_expert_slots(x, ids, w13, s13, b13, w2, s2, b2, x_quant=xq)
    else:
        align = get_m_alignment_for_contiguous_layout()
        counts = torch.bincount(ids.reshape(-1).long(), minlength=e).tolist()
        m_indices = torch.cat([torch.cat([torch.full((c,), i, dtype=torch.int32),
                                          torch.full((-c % align,), -1, dtype=torch.int32)])
                               for i, c in enumerate(counts)]).cuda()
        m = m_indices.numel()
        a = per_token_cast_to_fp8(_pad_k(torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)))
        a = (a[0], deep_gemm.get_col_major_tma_aligned_tensor(a[1]))
        gu, dn = _grouped_weights(e, 2 * INTER, g), _grouped_weights(e, HIDDEN, g)
        gu_out = torch.empty(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        dn_out = torch.empty(m, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def run():
            deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(a, gu, gu_out, m_indices)
            deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(a, dn, dn_out, m_indices)
    flops = 2.0 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    ms = _ms(run)
    n, dt = back_to_back(run, seconds)
    b2b = dt / n * 1e3
    print(f"{who}: MoE GEMMs E={e} T={t}: burst {ms:.3f} ms ({_tflops(flops, ms):.0f} TFLOP/s); back to back {n} "
          f"launches in {dt:.1f} s: {b2b:.3f} ms each ({_tflops(flops, b2b):.0f} TFLOP/s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--back-to-back", choices=("deepgemm", "ours"), default=None,
                   help="only launch this side's MoE GEMMs back to back (E=32, T=32768) for --seconds")
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.back_to_back:
        moe_back_to_back(args.back_to_back, 32, 32768, args.seconds, g)
        return
    rows = []
    for e, t in MOE:
        rows.append(moe_rows(e, t, g))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    for name, m, n, k in DENSE:
        rows.append(dense_row(name, m, n, k, g))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Which scale layouts make torch's blockwise FP8 ``_scaled_mm`` (cuBLAS) right for K = 2880?

A probe, not a benchmark: for the gpt-oss dense shapes at M = 1024 it runs ``_scaled_mm`` with
1x128 activation scales and 128x128 weight scales in several layouts and prints each one's
relative error against ``quant.fp8.block_gemm_reference`` (fp32 math on the same FP8 operands),
or the error torch raises. The bench's peer (bench/kernels_gemm.cublas_blockwise: K padded to a
multiple of 512, zero scale columns) is the first; fourteenth session, H200: it alone is right for
K = 2880 (6.9e-4), K to the 128 grid gives rel. err. 2.4 / 1100, a 16-byte aligned scale leading
dimension is refused ("Invalid scaling configuration").

Run on the GPU machine: ``PYTHONPATH=$(pwd) python3 benchmarks/cublas_layout_probe.py``
"""

from __future__ import annotations

import torch

from gptoss_fp8.bench.kernels_gemm import cublas_blockwise, pad_k, rel_errors
from gptoss_fp8.quant.fp8 import block_gemm_reference, quantize_act, quantize_weight_blocks


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in (("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("5760", 5760, 2880)):
        x_fp8, x_s = quantize_act(torch.randn(1024, k, device="cuda", generator=g))
        w_fp8, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.05)
        ref = block_gemm_reference(x_fp8, x_s, w_fp8, w_s, None)
        layouts = {
            "bench peer (K to 512, zero scale columns)": cublas_blockwise(x_fp8, x_s, w_fp8, w_s),
            "K to 128, b_scale w_s.t()": lambda: torch._scaled_mm(
                pad_k(x_fp8), pad_k(w_fp8).t(), scale_a=x_s.t().contiguous().t(), scale_b=w_s.t(),
                out_dtype=torch.bfloat16),
            "K to 128, b_scale row-major [K/128, N/128]": lambda: torch._scaled_mm(
                pad_k(x_fp8), pad_k(w_fp8).t(), scale_a=x_s.t().contiguous().t(), scale_b=w_s.t().contiguous(),
                out_dtype=torch.bfloat16),
        }
        for label, fn in layouts.items():
            try:
                rel, mx = rel_errors(fn(), ref)
                print(f"{name:>6} M=1024 | {label:<44}: rel {rel:.2e}, max {mx:.2e}", flush=True)
            except RuntimeError as e:
                print(f"{name:>6} M=1024 | {label:<44}: {str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    main()

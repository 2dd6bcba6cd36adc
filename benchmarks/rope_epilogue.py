"""The q/k rope in the q/k/v GEMM's epilogue against the GEMM followed by the rope kernel
(gpt-oss 20b/120b attention shapes: 64 q / 8 kv heads of 64, hidden 2880), device time under CUDA
graph replay, both in one process on the same tensors.

Usage (GPU machine): python3 benchmarks/rope_epilogue.py [--tokens 1024,8192,32768]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, rope_pair_rows
from gptoss_fp8.kernels.rope import rope_cos_sin, rope_qk
from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

HQ, HKV, D, H = 64, 8, 64, 2880


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1024,8192,32768")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = (HQ + 2 * HKV) * D
    w, s = quantize_weight_blocks(torch.randn(n, H, device="cuda", generator=g) / 50)
    b = (torch.randn(n, device="cuda", generator=g) / 10).to(torch.bfloat16)
    rot = (HQ + HKV) * D
    perm = torch.cat([rope_pair_rows(HQ + HKV, D, "cuda"), torch.arange(rot, n, device="cuda")])
    wp, bp = w[perm].contiguous(), b[perm].contiguous()
    for t in [int(x) for x in a.tokens.split(",") if x]:
        x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
        xq, xs = quantize_act(x)
        cos, sin = rope_cos_sin(t, D, device="cuda")
        pos = torch.arange(t, device="cuda", dtype=torch.int32)

        def separate():
            y = fp8_gemm(xq, xs, w, s, b)
            return rope_qk(y[:, :HQ * D].view(t, HQ, D), y[:, HQ * D:rot].view(t, HKV, D), pos, cos, sin)

        def fused():
            return fp8_gemm(xq, xs, wp, s, bp, rope=(cos, sin, rot))

        def plain():
            return fp8_gemm(xq, xs, w, s, b)

        fq, fk = separate()
        y = fused()
        same = torch.equal(y[:, :rot], torch.cat([fq.reshape(t, -1), fk.reshape(t, -1)], 1)[:, perm[:rot]])
        res = {}
        for rep in range(2):
            for name, fn in (("gemm only", plain), ("gemm + rope kernel", separate), ("gemm with rope epilogue", fused)):
                res.setdefault(name, []).append(do_bench_cudagraph(fn, rep=100) * 1e3)
        line = ", ".join(f"{k} {min(v):.1f} us" for k, v in res.items())
        print(f"T={t}: {line}; saved {min(res['gemm + rope kernel']) - min(res['gemm with rope epilogue']):.1f} us; "
              f"bit-identical (permuted): {same}", flush=True)


if __name__ == "__main__":
    main()

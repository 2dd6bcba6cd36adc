"""The FP8 attention's Q / K quantization (kernels/attn_quant.py ``quantize_qk``) on other launch shapes: heads a
program x warps x grid order, q with its rope fused and k without, as the model calls them (views of the q / k / v GEMM's
[T, 5120] output, 64 q / 8 kv heads of 64), beside the bytes they move. Every shape's bytes and scales are checked
equal to the default's (the same arithmetic per value; the block maximum is order-free). Issue 34.

Usage (GPU machine): python3 benchmarks/qk_quant_sweep.py [--tokens 32768,128000]
"""

from __future__ import annotations

import argparse

import torch
import triton

from gptoss_fp8.kernels.attn_quant import qk_tile, quantize_qk

SHAPES = [(1, 4, True), (1, 8, True), (2, 4, True), (2, 8, True), (4, 4, True), (1, 8, False), (2, 4, False),
          (4, 8, False)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="32768,128000")
    a = p.parse_args()
    for t in [int(x) for x in a.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(t)
        qkv = torch.randn(t, 5120, device="cuda", generator=g).bfloat16()
        q, k = qkv[:, :4096].view(t, 64, 64), qkv[:, 4096:4608].view(t, 8, 64)
        ang = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * torch.logspace(0, -4, 32, device="cuda")
        rope = (ang.cos().contiguous(), ang.sin().contiguous())
        for name, x, r in (("q + rope", q, rope), ("k", k, None)):
            ref8, refs = quantize_qk(x, rope=r)
            moved = x.numel() * 3  # bf16 read, e4m3 written
            default = qk_tile(x.shape[1], 64, r is not None)
            for shape in [default] + [s for s in SHAPES if s != default and s[0] <= x.shape[1]]:
                x8, xs = quantize_qk(x, rope=r, tile=shape)
                same = torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8)) and torch.equal(xs, refs)
                ms = triton.testing.do_bench(lambda x=x, r=r, shape=shape: quantize_qk(x, rope=r, tile=shape),
                                             warmup=25, rep=200)
                print(f"{t} {name:8s} heads {shape[0]} warps {shape[1]:2d} {'heads-fast' if shape[2] else 'rows-fast '}"
                      f"{' (default)' if shape == default else '':10s}: "
                      f"{ms:.4f} ms, {moved / ms / 1e9:.2f} TB/s | same bytes: {same}", flush=True)


if __name__ == "__main__":
    main()

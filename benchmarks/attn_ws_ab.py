"""Causal prefill attention with sinks: the Gluon warp-specialized kernel (kernels/attention_ws.py)
against the Triton kernel (kernels/attention.py), same process, same inputs (q/k/v as views of one
fused q/k/v projection output, as in the model), 64 query / 8 KV heads, head_dim 64.

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/attn_ws_ab.py [T ...]`` (default 8192
32768). FLOPs: 4 * visible (query, key) pairs * 64 * 64 heads. Median of do_bench, two passes.
"""
import sys

import torch
from triton.testing import do_bench

from gptoss_fp8.kernels import attention as attn


VARIANTS = [dict(block_n=64, stages=3, warpgroups=2), dict(block_n=128, stages=3, warpgroups=2),
            dict(block_n=64, stages=3, warpgroups=3), dict(block_n=64, stages=4, warpgroups=3)]


def main(lengths):
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 64, 8, 64
    for T in lengths:
        fused = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
        q, k, v = (t.view(T, -1, d) for t in fused.split([hq * d, hkv * d, hkv * d], dim=1))
        sinks = torch.randn(hq, device="cuda", generator=g)
        flops = 4 * (T * (T + 1) // 2) * d * hq

        def run(variant):
            old = attn.WS_ATTENTION, attn.WS_CONFIG
            attn.WS_ATTENTION, attn.WS_CONFIG = variant is not None, variant or old[1]
            try:
                return attn.attention_prefill(q, k, v, sinks)
            finally:
                attn.WS_ATTENTION, attn.WS_CONFIG = old

        base = run(None)
        for rep in range(2):
            for variant in [None, *VARIANTS]:
                rel = ((run(variant).float() - base.float()).norm() / base.float().norm()).item()
                ms = do_bench(lambda: run(variant), warmup=50, rep=300 if T <= 32768 else 2000)
                name = "triton" if variant is None else "gluon " + " ".join(f"{k}={v}" for k, v in variant.items())
                print(f"T={T} pass {rep} {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) | "
                      f"vs triton rel {rel:.2e}", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [8192, 32768])

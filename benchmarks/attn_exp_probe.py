"""Is the causal prefill attention bound by the MUFU unit's 2^x? The Gluon kernel (attention_ws.py)
with the unmasked blocks' 2^x computed by EXP mode: 0 MUFU (default), 1 an FMA-pipe polynomial,
2 not at all (p = scores: wrong values, a timing bound), 3 half and half (even columns MUFU, odd
polynomial). Same process, same inputs, passes interleaved; relative difference against mode 0.

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/attn_exp_probe.py [T ...]`` (default 8192 32768).
"""
import sys

import torch
from triton.testing import do_bench

from gptoss_fp8.kernels import attention as attn
from gptoss_fp8.kernels.attention_ws import ws_attention_prefill

MODES = {0: "mufu", 1: "poly", 2: "none (bound)", 3: "mixed"}


def main(lengths):
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 64, 8, 64
    for T in lengths:
        fused = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
        q, k, v = (t.view(T, -1, d) for t in fused.split([hq * d, hkv * d, hkv * d], dim=1))
        sinks = torch.randn(hq, device="cuda", generator=g)
        flops = 4 * (T * (T + 1) // 2) * d * hq
        out = torch.empty_like(q)
        for cfg in (attn.WS_CONFIG, {"block_n": 128, "stages": 3, "warpgroups": 2}):
            def run(mode, cfg=cfg, args=(q, k, v, sinks, out)):
                return ws_attention_prefill(*args, d ** -0.5, exp=mode, **cfg)

            base = run(0).float().clone()
            for rep in range(2):
                for mode, name in MODES.items():
                    rel = ((run(mode).float() - base).norm() / base.norm()).item()
                    ms = do_bench(lambda m=mode: run(m), warmup=50, rep=300 if T <= 32768 else 2000)
                    print(f"T={T} {cfg} pass {rep} exp={mode} {name}: {ms:.3f} ms "
                          f"({flops / ms / 1e9:.0f} TFLOP/s) | vs mufu rel {rel:.2e}", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [8192, 32768])

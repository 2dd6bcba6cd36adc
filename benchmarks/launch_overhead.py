"""Host cost of one call (launch only, no sync) against its GPU time, for the dense FP8 GEMM and the
fused MoE at small sizes: tells whether plain-launch timings at small M are host-bound.

Usage (GPU machine): python3 benchmarks/launch_overhead.py
"""

from __future__ import annotations

import time

import torch

from gptoss_fp8.bench.kernels_gemm import TOP_K, _dense_weights, _moe_fp8_weights, _ms, _ms_graph
from gptoss_fp8.kernels.fp8_gemm import dense_config, fp8_gemm
from gptoss_fp8.kernels.moe import fused_moe
from gptoss_fp8.quant.fp8 import quantize_act


def host_us(fn, n: int = 200) -> float:
    """Mean host time per call while the GPU queue stays non-empty (no sync inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.cuda.get_device_properties(0)
    print(f"get_device_properties: {(time.perf_counter() - t0) * 1e3:.2f} us per call")
    w, s, b = _dense_weights(5120, 2880, g)
    for m in (1024, 2048, 4096, 8192):
        xq, xs = quantize_act(torch.randn(m, 2880, device="cuda", generator=g))
        cfg = dense_config(m, 5120, 2880)
        for label, fn in (("default", lambda: fp8_gemm(xq, xs, w, s, b)),
                          ("explicit", lambda c=cfg: fp8_gemm(xq, xs, w, s, b, config=c))):
            dev, plain = _ms_graph(fn) * 1e3, _ms(fn) * 1e3
            print(f"dense qkv M={m} {label}: host {host_us(fn):.1f} us/call, graph {dev:.1f} us, plain do_bench {plain:.1f} us")
    w13, s13, b13, w2, s2, b2, wr, br = _moe_fp8_weights(32, g)
    for t in (1024, 8192):
        x = torch.randn(t, 2880, device="cuda", generator=g).to(torch.bfloat16)
        fn = lambda x=x: fused_moe(x, wr, br, w13, s13, b13, w2, s2, b2, top_k=TOP_K)  # noqa: E731
        dev, plain = _ms_graph(fn) * 1e3, _ms(fn) * 1e3
        print(f"moe E=32 T={t}: host {host_us(fn, 50):.1f} us/call, graph {dev:.1f} us, plain do_bench {plain:.1f} us")
    # where the host time of a dense call goes (Python side; the driver calls show as builtins)
    import cProfile
    import pstats

    xq, xs = quantize_act(torch.randn(1024, 2880, device="cuda", generator=g))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fp8_gemm(xq, xs, w, s, b)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""The sliding-window (128-key) prefill attention's Triton tiles side by side (issue 34: the window layers at their bound).

gpt-oss's shapes (64 query / 8 KV heads, head dim 64, bf16, sinks), one sequence of T tokens: each ``PrefillTile``
of TILES is checked against ``spec.attention_varlen`` on the first 4096 tokens (rel. error), then timed (event
median) at every T, beside the bytes floor (Q read + O written + K, V read once, at 4.0 TB/s).

    PYTHONPATH=$(pwd) python3 benchmarks/window_sweep.py [--tokens 8192,32768,128000]
"""

from __future__ import annotations

import argparse

import torch
import triton

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention import attention_prefill
from gptoss_fp8.kernels.config import DEFAULT, PrefillTile

HQ, HKV, D, WINDOW = 64, 8, 64, 128
TILES = {
    "default": None,
    "64x32 p2 w4 s2": PrefillTile(64, 32, 4, 2, maxnreg=128, pack=2),
    "128x32 p4 w4 s2": PrefillTile(128, 32, 4, 2, maxnreg=128, pack=4),
    "128x32 p4 w4 s2 r-": PrefillTile(128, 32, 4, 2, pack=4),
    "128x32 p4 w4 s3": PrefillTile(128, 32, 4, 3, maxnreg=128, pack=4),
    "128x32 p4 w4 s1": PrefillTile(128, 32, 4, 1, maxnreg=128, pack=4),
    "128x64 p2 w4 s2": PrefillTile(128, 64, 4, 2, maxnreg=128, pack=2),
    "256x32 p4 w8 s2": PrefillTile(256, 32, 8, 2, pack=4),
    "128x16 p8 w4 s2": PrefillTile(128, 16, 4, 2, maxnreg=128, pack=8),
    "128x16 p4 w4 s2": PrefillTile(128, 16, 4, 2, maxnreg=128, pack=4),
    "256x32 p8 w4 s2": PrefillTile(256, 32, 4, 2, pack=8),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768,128000")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    sinks = (torch.rand(HQ, device="cuda", generator=g) * 4 - 2).bfloat16()
    print(f"# default window tile: {DEFAULT.prefill_tile(True, True, HQ // HKV)}")
    n = 4096
    q, k, v = (torch.randn(n, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV))
    ref = spec.attention_varlen(q.float(), k.float(), v.float(), sinks.float(), None, window=WINDOW)
    ok = {}
    for name, tile in TILES.items():
        out = attention_prefill(q, k, v, sinks, sliding_window=WINDOW, tile=tile)
        ok[name] = _rel(out.float(), ref)
    for t in (int(x) for x in a.tokens.split(",")):
        q, k, v = (torch.randn(t, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HKV, HKV))
        floor_ms = 2 * t * (2 * HQ + 2 * HKV) * D / 4.0e12 * 1e3
        print(f"T {t}: bytes floor {floor_ms:.3f} ms at 4.0 TB/s")
        for name, tile in TILES.items():
            ms = triton.testing.do_bench(lambda tile=tile: attention_prefill(q, k, v, sinks, sliding_window=WINDOW,
                                                                             tile=tile),
                                         warmup=10, rep=100, return_mode="median")
            print(f"  {name:18s} {ms:8.3f} ms  x{ms / floor_ms:5.2f} floor  rel {ok[name]:.2e}")


if __name__ == "__main__":
    main()

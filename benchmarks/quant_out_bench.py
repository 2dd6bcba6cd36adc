"""The window layer's attention with o_proj's input quantization fused (``attention_prefill(quant_out=True)``)
against its bf16 rows alone and the rows + act_quant (the unfused pair), gpt-oss's shapes (64 q / 8 kv heads,
head_dim 64, window 128, q's rope fused), the default tile. Issue 34, thirty-eighth session.

Usage (GPU machine): python3 benchmarks/quant_out_bench.py [--tokens 32768,128000] [--tiles] [--full] [--rounds 5]
``--tiles``: the fused form on other tiles too (TILES), each checked against the default's bytes. ``--full``: a full
layer's FP8 attention instead (``--attention fp8``: the Gluon FP8 kernel, the fused form two heads a program,
``KernelConfig.attention_fp8_quant_out``, forty-third session).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import triton

from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.attention import attention_prefill
from gptoss_fp8.kernels.config import KernelConfig, PrefillTile

TILES = {  # (the default: 128 x 32, four heads, 4 warps, 2 stages, 128 registers)
    "128x32 p4 w8 s2": PrefillTile(128, 32, 8, 2, pack=4),
    "128x32 p4 w4 s2 r-": PrefillTile(128, 32, 4, 2, pack=4),
    "128x32 p4 w4 s3": PrefillTile(128, 32, 4, 3, maxnreg=128, pack=4),
    "128x16 p8 w4 s2": PrefillTile(128, 16, 4, 2, maxnreg=128, pack=8),
    "256x32 p8 w8 s2": PrefillTile(256, 32, 8, 2, pack=8),
    "64x32 p2 w4 s2": PrefillTile(64, 32, 4, 2, maxnreg=128, pack=2),
    "128x64 p2 w4 s2": PrefillTile(128, 64, 4, 2, maxnreg=128, pack=2),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="32768,128000")
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--full", action="store_true", help="a full layer's FP8 attention (its Gluon kernel)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every way, order rotated a round")
    p.add_argument("--rep", type=int, default=100, help="do_bench's milliseconds a way and round")
    a = p.parse_args()
    on = dataclasses.replace(KernelConfig(), attention_fp8_quant_out=True)
    for t in [int(x) for x in a.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(t)
        q = torch.randn(t, 64, 64, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(t, 8, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        sinks = torch.rand(64, device="cuda", generator=g) * 4 - 2
        ang = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * torch.logspace(0, -4, 32, device="cuda")
        rope = (ang.cos().contiguous(), ang.sin().contiguous())
        kw = dict(sliding_window=0, fp8=True) if a.full else dict(sliding_window=128)
        kw["rope"] = rope

        def rows():
            return attention_prefill(q, k, v, sinks, **kw)

        def unfused():
            return act_quant(rows().view(t, -1))

        def fused():
            return attention_prefill(q, k, v, sinks, quant_out=True, **kw, **({"config": on} if a.full else {}))

        a8, as_ = unfused()
        f8, fs = fused()
        same = torch.equal(a8.view(torch.uint8), f8.view(torch.uint8)) and torch.equal(as_, fs)
        ways = [("rows", rows), ("rows + act_quant", unfused), ("fused", fused)]
        if a.full:  # the fused kernel's structure alone: two heads a program, bf16 rows (measurement option)
            from gptoss_fp8.kernels.attention_ws_fp8 import ws_attention_prefill_fp8

            out2 = torch.empty_like(q)

            def two_heads():
                return ws_attention_prefill_fp8(q, k, v, sinks, out2, 64 ** -0.5, rope=rope, two_heads=True)

            print(f"{t} tokens: two heads a program, the same bf16 rows: {torch.equal(two_heads(), rows())}")
            ways.insert(2, ("two heads a program, rows", two_heads))
        ways.append(("rows again", rows))
        # rounds, each way's order rotated a round: back to back at the power cap the card's state drifts (the same
        # kernel read 6% apart within one pass of do_bench blocks, forty-third session), so medians of rounds
        times = {name: [] for name, _ in ways}
        for rnd in range(a.rounds):
            for name, fn in ways[rnd % len(ways):] + ways[:rnd % len(ways)]:
                times[name].append(triton.testing.do_bench(fn, warmup=10, rep=a.rep))
        print(f"{t} tokens, {a.rounds} rounds (median, min-max): " + ", ".join(
            f"{n} {statistics.median(m):.4f} ({min(m):.4f}-{max(m):.4f}) ms" for n, m in times.items())
            + f" | fused bytes equal: {same}", flush=True)
        for name, tile in TILES.items() if a.tiles and not a.full else ():
            def tiled(tile=tile):
                return attention_prefill(q, k, v, sinks, quant_out=True, tile=tile, **kw)

            t8, ts = tiled()
            ok = torch.equal(t8.view(torch.uint8), f8.view(torch.uint8)) and torch.equal(ts, fs)
            print(f"  fused, {name}: {triton.testing.do_bench(tiled, warmup=50, rep=300):.4f} ms | bytes equal: {ok}",
                  flush=True)


if __name__ == "__main__":
    main()

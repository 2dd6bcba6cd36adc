"""The window layer's attention with o_proj's input quantization fused (``attention_prefill(quant_out=True)``)
against its bf16 rows alone and the rows + act_quant (the unfused pair), gpt-oss's shapes (64 q / 8 kv heads,
head_dim 64, window 128, q's rope fused), the default tile. Issue 34, thirty-eighth session.

Usage (GPU machine): python3 benchmarks/quant_out_bench.py [--tokens 32768,128000]
"""

from __future__ import annotations

import argparse

import torch
import triton

from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.attention import attention_prefill


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="32768,128000")
    a = p.parse_args()
    for t in [int(x) for x in a.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(t)
        q = torch.randn(t, 64, 64, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(t, 8, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
        sinks = torch.rand(64, device="cuda", generator=g) * 4 - 2
        ang = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * torch.logspace(0, -4, 32, device="cuda")
        rope = (ang.cos().contiguous(), ang.sin().contiguous())
        kw = dict(sliding_window=128, rope=rope)

        def rows():
            return attention_prefill(q, k, v, sinks, **kw)

        def unfused():
            return act_quant(rows().view(t, -1))

        def fused():
            return attention_prefill(q, k, v, sinks, quant_out=True, **kw)

        a8, as_ = unfused()
        f8, fs = fused()
        same = torch.equal(a8.view(torch.uint8), f8.view(torch.uint8)) and torch.equal(as_, fs)
        ms = {name: triton.testing.do_bench(fn, warmup=50, rep=300) for name, fn in
              (("rows", rows), ("rows + act_quant", unfused), ("fused", fused), ("rows again", rows))}
        print(f"{t} tokens: " + ", ".join(f"{n} {m:.4f} ms" for n, m in ms.items()) + f" | fused bytes equal: {same}",
              flush=True)


if __name__ == "__main__":
    main()

"""One launch of the warp-specialized causal attention (kernels/attention_ws.py) for Nsight Compute
(issue 34): where its cycles go (tensor pipe, MUFU / XU pipe, issue slots, warp stalls). The first
launches compile and warm up; profile the last one:

    ncu --clock-control none --set full -k regex:_ws_attention --launch-skip 2 --launch-count 1 \
        -o OUT python3 benchmarks/attn_ncu.py [--tokens 16384] [--variant KEY=VALUE,...]

With --seconds S it then runs back to back for S seconds: under benchmarks/clock_watch.py that gives
the SM clock and board power this kernel alone holds (is it at the power cap?).
"""

from __future__ import annotations

import argparse
import ast

import torch
from clock_watch import back_to_back

from gptoss_fp8.kernels.attention_ws import ws_attention_prefill
from gptoss_fp8.kernels.attention_ws_fp8 import ws_attention_prefill_fp8

D = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--variant", default="", help="ws_attention_prefill keywords, e.g. deep=True,stages=4")
    ap.add_argument("--sdpa", action="store_true", help="time torch's SDPA (causal, no sinks, GQA) instead")
    ap.add_argument("--seconds", type=float, default=0.0, help="then launch it back to back this long (for "
                    "benchmarks/clock_watch.py: clock and power under this kernel alone)")
    args = ap.parse_args()
    opts = dict(block_n=64, stages=4, warpgroups=3)
    for kv in filter(None, args.variant.split(",")):
        key, val = kv.split("=")
        opts[key] = ast.literal_eval(val) if val[:1].isdigit() or val in ("True", "False") else val
    T, hq, hkv = args.tokens, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    fused = torch.randn(T, (hq + 2 * hkv) * D, device="cuda", generator=g).bfloat16()
    q, k, v = (t.view(T, -1, D) for t in fused.split([hq * D, hkv * D, hkv * D], dim=1))
    sinks = torch.rand(hq, device="cuda", generator=g) * 20 - 10
    out = torch.empty_like(q)
    if args.sdpa:
        import torch.nn.functional as F

        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

        def run():
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    elif opts.pop("fp8", False):
        fp8_opts = {k: v for k, v in opts.items() if k not in ("block_n", "warpgroups")}

        def run():
            ws_attention_prefill_fp8(q, k, v, sinks, out, D ** -0.5, **fp8_opts)
    else:
        def run():
            ws_attention_prefill(q, k, v, sinks, out, D ** -0.5, **opts)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    n, dt = back_to_back(run, args.seconds)
    print("ran", "sdpa" if args.sdpa else opts, T, f"{n} launches in {dt:.1f} s: {dt / max(n, 1) * 1e3:.3f} ms each" if n else "")


if __name__ == "__main__":
    main()

"""Is the MoE gate_up GEMM (kernels/moe_ws.py) bound by its loads or by its MMAs? (temporary probe)

Times the Gluon gate_up alone at gpt-oss shapes (H = I = 2880, top-4) with GPTOSS_FP8_MOE_PROBE
set in the environment before import: 0 = as shipped, 1 = loads only (consumers skip the MMAs),
2 = MMAs only (the producer skips the loads). Run once per value, in separate processes.
Usage (GPU machine): GPTOSS_FP8_MOE_PROBE=1 python3 benchmarks/moe_bound_probe.py
"""

from __future__ import annotations

import os

import torch
import triton

from gptoss_fp8.kernels import moe_ws
from gptoss_fp8.kernels.moe import gather_act_quant, moe_align
from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX, quantize_weight_blocks

H = I = 2880


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    probe = os.environ.get("GPTOSS_FP8_MOE_PROBE", "0")
    for e, t in [(128, 8192), (32, 8192), (32, 32768)]:
        w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * I, H, device="cuda", generator=g) * H**-0.5)
        b13 = torch.randn(e, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:4] for _ in range(t)]).int()
        slots, block_expert = moe_align(ids, 0, e, 64)
        a, a_s = gather_act_quant(x, slots, 4)
        act = torch.empty(slots.shape[0], I, dtype=torch.float8_e4m3fn, device="cuda")
        act_s = torch.empty(slots.shape[0], I // 128 + (I % 128 > 0), dtype=torch.float32, device="cuda")

        def run(w13=w13, s13=s13):
            moe_ws.ws_moe_gemm(a, a_s, w13, s13, b13, act, act_s, slots, block_expert, t * 4, 7.0, True, 1.702,
                               FP8_MAX, ACT_EPS)

        ms = [triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") for _ in range(3)]
        useful = 2.0 * t * 4 * H * 2 * I
        tiles = int((block_expert < e).sum())
        print(f"probe {probe} | E={e} T={t} | gate_up {min(ms):.3f} ms (runs {', '.join(f'{m:.3f}' for m in ms)}) | "
              f"{useful / min(ms) / 1e9:.0f} TFLOP/s useful, {tiles * 64 / (t * 4) - 1:.1%} padding rows", flush=True)
        del w13, s13
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Kernel-level profile of one prefill (torch.profiler): where the GPU time of a forward goes.

Usage (on the GPU machine): python3 benchmarks/profile_prefill.py --model 20b --layers 4 --tokens 8192 [--attention fp8]
Prints the top CUDA kernels by total GPU time and the GPU-busy fraction of the wall time.
"""

from __future__ import annotations

import argparse
import time

import torch

from gptoss_fp8.bench.prefill import prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.model.ops import ATTENTION_KINDS
from gptoss_fp8.model.triton_ops import TritonOps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="bf16", help="prefill attention numerics")
    a = p.parse_args()
    cfg = preset_config(a.model, a.layers)
    model = random_model(cfg, "cuda")
    # the default KernelConfig (GPTOSS_FP8_GLUON=0 switches the Gluon kernels off)
    ops = TritonOps().with_attention(a.attention)
    from gptoss_fp8.kernels.config import kernel_paths

    print(f"# {kernel_paths(torch.device('cuda'), ops.config)}")
    tokens = torch.randint(0, cfg.vocab_size, (a.tokens,), device="cuda")
    for _ in range(3):
        prefill_logits(model, tokens, ops)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prefill_logits(model, tokens, ops)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"# {a.model} {a.layers} layers, {a.tokens} tokens: wall {wall * 1e3:.2f} ms (profiled), "
          f"GPU kernel time {gpu_total:.2f} ms ({100 * gpu_total / (wall * 1e3):.0f}% busy)")
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[: a.rows]:
        print(f"{e.self_device_time_total / 1e3:9.3f} ms  {e.count:5d} x  {e.key[:110]}")


if __name__ == "__main__":
    main()

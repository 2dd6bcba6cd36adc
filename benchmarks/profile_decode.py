"""Kernel-level profile of decode steps replayed as CUDA graphs (torch.profiler): where one step's
GPU time goes, kernel by kernel, beside the step's replay time and its HBM floor.

Usage (on the GPU machine): python3 benchmarks/profile_decode.py --model 20b --batch 1 --context 8192
Prints, per case, the graph step (median of replays, CUDA events), the sum of kernel times per
step, and the top kernels by GPU time per step (count per step, microseconds per step, and per
launch). The gap between the step and the kernel sum is idle time between kernels in the graph.
With PDL (the default for decode) a kernel's time includes its wait for the one before, so the
kernel sum can exceed the step: ``--no-pdl`` gives per-kernel figures that add up.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gptoss_fp8.bench.decode import HBM_BPS, floor_bytes, set_context, synthetic_cache
from gptoss_fp8.bench.prefill import random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.graph import DecodeGraphs
from gptoss_fp8.model.triton_ops import TritonOps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", default="1")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch: under PDL a kernel's profiled time includes "
                        "its wait for the one before, so per-kernel times overlap and do not add up to the step")
    a = p.parse_args()
    cfg = preset_config(a.model, a.layers)
    model = random_model(cfg, "cuda")
    ops = TritonOps(config=KernelConfig(pdl_max_rows=None) if a.no_pdl else None)
    from torch.profiler import ProfilerActivity, profile

    for batch in [int(b) for b in a.batch.split(",")]:
        cache = synthetic_cache(model, batch, a.context, a.context + 1)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        graphs = DecodeGraphs(model, ops)
        times = []
        for i in range(200):
            set_context(cache, a.context)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs.step(cache, tokens)
            e.record()
            e.synchronize()
            if i >= 50:
                times.append(s.elapsed_time(e) * 1e3)
        step_us = statistics.median(times)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                set_context(cache, a.context)
                graphs.step(cache, tokens)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        # per step, the lengths reset (set_context's fill, outside the graph) included: ~1 us
        per_step = [(e.self_device_time_total / a.steps, e.count / a.steps, e.key) for e in events]
        total = sum(t for t, _, _ in per_step)
        floor_us = floor_bytes(cfg, batch, a.context)["total"] / HBM_BPS * 1e6
        print(f"# {a.model} {cfg.num_hidden_layers} layers, batch {batch}, context {a.context}: graph step "
              f"{step_us:.1f} us (median of 150), kernels {total:.1f} us per step (incl. the lengths reset), "
              f"floor {floor_us:.1f} us")
        per_step.sort(key=lambda r: -r[0])
        for t, n, key in per_step[: a.rows]:
            print(f"{t:9.1f} us  {n:6.1f} x  {t / max(n, 1e-9):7.2f} us/launch  {key[:100]}")
        del cache, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

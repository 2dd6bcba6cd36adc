"""Whole-model prefill A/B in one process: the same random model and tokens, the ``triton`` ops
backend with different MoE configurations, runs interleaved (A, B, A, B, ...) so clock drift and
machine-to-machine spread hit both alike.

Usage (GPU machine): python3 benchmarks/ab_prefill.py --model 20b --tokens 8192 --runs 10
Variants: "default" (moe_config's choice) and "pregather" (gate_up's A quantized straight into
sorted row order and read through TMA, the rest of the default configuration unchanged).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_fp8.bench.prefill import prefill_logits, random_model
from gptoss_fp8.convert.synth import preset_config
from gptoss_fp8.kernels.moe import moe_config
from gptoss_fp8.model.triton_ops import TritonOps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--tokens", default="8192")
    p.add_argument("--runs", type=int, default=10)
    a = p.parse_args()
    cfg = preset_config(a.model)
    model = random_model(cfg, "cuda")
    for n in [int(t) for t in a.tokens.split(",")]:
        base = moe_config(n, cfg.num_experts_per_tok, cfg.num_local_experts)
        variants = {"default": TritonOps(), "pregather": TritonOps(moe_config=dict(base, PREGATHER=True))}
        tokens = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
        ref = None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0:  # warm-up: compile both, let clocks settle
            for ops in variants.values():
                out = prefill_logits(model, tokens, ops)
                ref = out if ref is None else ref
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, ops in variants.items():
                torch.cuda.synchronize()
                s = time.perf_counter()
                out = prefill_logits(model, tokens, ops)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - s)
        for name, ts in times.items():
            out = prefill_logits(model, tokens, variants[name])
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{a.model} {n} tokens | {name}: median {statistics.median(ts):.4f} s, "
                  f"min {min(ts):.4f}, max {max(ts):.4f} | logits vs default rel {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()

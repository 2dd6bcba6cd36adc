"""The serving engine's prompts of one step (``GptOss.prefill_many``) with each layer's attention in one launch
over all chunks (``KernelConfig.attention_segments``, thirtieth session) against a launch per chunk, same process,
runs interleaved (A, B, A, B, ...), on the random 20b (or --model) at real shapes: "segments" (the Triton kernel,
the default), "gluon-segments" (the full layers' on the bf16 Gluon kernel, ``attention_gluon_segments``), "per-chunk".
``--attention fp8`` (thirty-second session): the full layers' chunks on e4m3 operands in one launch
(attn_quant.SegmentPlan) against one FP8 launch (and quantization) per chunk.

Usage (GPU machine): python3 benchmarks/ab_prefill_many.py [--model 20b] [--runs 10] \\
    [--mixes 64x128,16x512,8x1024,8x1024@4096,2x4096]
A mix "BxN[@S]": B sequences' chunks of N tokens each, after S cached tokens (S 0: fresh prompts); the cache's
lengths are set back to S before every run. Prints each variant's median / min / max seconds and its logits'
relative difference from the first variant's (the same attention arithmetic: bf16 noise at most). Both variants
write the cache and gather a ring's keys for all chunks at once (``KVCache.chunk_rows``, the same session): the
A/B is the attention's launches alone; what the step gained before that shows in ``bench serve`` against the
nineteenth session's figures (another machine: about ±2%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_fp8.bench.prefill import random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.triton_ops import TritonOps


def _mix(text: str) -> tuple[int, int, int]:
    """"BxN[@S]" -> (B, N, S)."""
    head, _, start = text.partition("@")
    b, n = (int(v) for v in head.split("x"))
    return b, n, int(start or 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--mixes", default="64x128,16x512,8x1024,8x1024@4096,2x4096")
    p.add_argument("--attention", choices=("bf16", "fp8"), default="bf16",
                   help="prefill attention numerics (fp8: the full layers' chunks on e4m3 operands, in one launch by "
                        "attn_quant.SegmentPlan or one by one; no gluon-segments row: the Gluon one is bf16's)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run through Triton's interpreter (TRITON_INTERPRET=1)")
    a = p.parse_args()
    cfg = preset_config(a.model)
    dev = torch.device(a.device)
    model = random_model(cfg, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    variants = {name: TritonOps(config=cfg).with_attention(a.attention) for name, cfg in (
        ("segments", KernelConfig(attention_segments=True)),
        ("gluon-segments", KernelConfig(attention_gluon_segments=True)),
        ("per-chunk", KernelConfig(attention_segments=False))) if a.attention == "bf16" or name != "gluon-segments"}
    for text in a.mixes.split(","):
        b, n, start = _mix(text)
        cache = model.new_cache(start + n + 1, batch=b)
        gen = torch.Generator().manual_seed(b * n + start)
        if start:  # the cached tokens, prefilled once
            for r in range(b):
                model.prefill(torch.randint(0, cfg.vocab_size, (start,), generator=gen).to(dev),
                              variants["segments"], cache=cache, row=r)
        chunks = [(r, torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(dev), start) for r in range(b)]

        # a chunk overwrites the rings' rows of the cached keys: their contents restored before every run (untimed)
        rings = [i for i in range(len(cache.k)) if cache.is_ring(i)]
        saved = {i: (cache.k[i].clone(), cache.v[i].clone()) for i in rings} if start else {}

        def reset(cache=cache, b=b, start=start, saved=saved):
            for i, (k, v) in saved.items():
                cache.k[i].copy_(k)
                cache.v[i].copy_(v)
            for r in range(b):
                cache.set_length(r, start)

        def run(ops, chunks=chunks, cache=cache, reset=reset):
            reset()
            return model.prefill_many(chunks, ops, cache)

        ref = None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:  # warm-up: compile both, let clocks settle
            for ops in variants.values():
                out = run(ops)
                ref = out.clone() if ref is None else ref
            sync()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, ops in variants.items():
                reset()
                sync()
                s = time.perf_counter()
                model.prefill_many(chunks, ops, cache)
                sync()
                times[name].append(time.perf_counter() - s)
        for name, ts in times.items():
            out = run(variants[name])
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{a.model} prefill_many {text} ({b * n} tokens) | {name}: median {statistics.median(ts) * 1e3:.2f} ms, "
                  f"min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f} | logits vs first rel {diff:.2e}", flush=True)
        del cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

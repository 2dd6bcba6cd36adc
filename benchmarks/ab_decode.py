"""Decode-step A/B in one process: the same random model, cache and tokens; variants of the kernel
configuration, each its own CUDA graph, replays interleaved (A, B, A, B, ...) so clock drift hits
all alike.

Usage (GPU machine): PYTHONPATH=$(pwd) python3 benchmarks/ab_decode.py --model 20b --batch 1,8,64 \\
    --context 8192 --variants default,wgmma [--replays 200]
Variants (``dataclasses.replace`` of the default ``KernelConfig``, kernels/config.py):
"default" (as shipped), "wgmma" (the MoE decode kernels on the 64-row fp8 wgmma tile,
moe_skinny_wgmma=True), "no-pdl" / "pdl" (programmatic dependent launch of the decode kernels
off / on), "grouped" (the routed experts on the grouped prefill path: moe_skinny_max_slots=None),
"tiled-dense" (the dense GEMMs on the tiled kernels: dense_skinny_max_rows=None); "pdl-down" (PDL,
and the decode MoE's down launch with it too: moe_gemv.PDL_DOWN set while that variant's graph is
captured, which is when launches are decided); "strict-one-wave" (batch-1 decode attention on the
one-wave split form only where every one of its ~2 programs per SM gets 4 key blocks, as before the
fourteenth session: at 8192 cached tokens the ``decode`` tile then runs; measured 2056.3 against
2035.5 us for the shipped rule, which takes down to 3/4 of the splits); "moe-s5" / "moe-k2" /
"moe-k4" (the decode MoE's tiles as shipped, 4 stages of one 128-wide K block = 3 blocks in flight,
against 4 blocks in flight three ways: 5 stages of one block, 3 stages of 2 blocks a step, 2 stages
of 4 (``MoeSkinnyTile.k_step``: 128 / 256 / 512 contiguous bytes of every weight row a step; the
three share their bytes in flight, so they tell contiguity from depth: the DRAM-locality
hypothesis of BENCHMARKS.md; bit-identical logits, CPU test; not measured yet).
Prints per case and variant the median replay time (CUDA events, us) and the logits' relative
difference from the first variant's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
from dataclasses import replace

import torch

from gptoss_fp8.bench.decode import HBM_BPS, floor_bytes, set_context, synthetic_cache
from gptoss_fp8.bench.prefill import random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.graph import DecodeGraphs
from gptoss_fp8.model.triton_ops import TritonOps

VARIANTS = {
    "default": {},
    "wgmma": {"moe_skinny_wgmma": True},
    "pdl": {"pdl_max_rows": 64},
    "no-pdl": {"pdl_max_rows": None},
    "grouped": {"moe_skinny_max_slots": None},
    "tiled-dense": {"dense_skinny_max_rows": None},
    "pdl-down": {"pdl_max_rows": 64},
    "strict-one-wave": {},
    "moe-s5": {},
    "moe-k2": {},
    "moe-k4": {},
}


def _one_wave_strict(tiles: int, l_max: int, windowed: bool, sms: int, config=None):
    """attention_decode.one_wave_splits as it was before the fourteenth session: None unless every
    split gets 4 key blocks."""
    from gptoss_fp8.kernels.attention_decode import DEFAULT, cdiv

    cfg = config or DEFAULT
    want = cdiv(cfg.decode_one_wave_programs_per_sm * sms, tiles)
    if windowed or tiles * 16 > sms or cdiv(l_max, cfg.decode_one_wave.block_n) < 4 * want:
        return None
    return want


def _moe_tile(k_step: int, num_stages: int):
    """moe_gemv.moe_skinny_tile as shipped, with ``k_step`` K blocks a pipelined step and
    ``num_stages`` pipeline stages (Triton keeps num_stages - 1 steps in flight)."""
    from gptoss_fp8.kernels import moe_gemv

    shipped = moe_gemv.moe_skinny_tile

    def tile(num_slots: int, two_i: int, h: int, sms: int):
        return replace(shipped(num_slots, two_i, h, sms), k_step=k_step, num_stages=num_stages)

    return tile


# module attributes set while a variant's graph is captured: (module, name) -> a function giving the
# value (called when the variant is patched, so a value may wrap what the module holds then)
PATCHES = {"pdl-down": {("gptoss_fp8.kernels.moe_gemv", "PDL_DOWN"): lambda: True},
           "strict-one-wave": {("gptoss_fp8.kernels.attention_decode", "one_wave_splits"): lambda: _one_wave_strict},
           "moe-s5": {("gptoss_fp8.kernels.moe_gemv", "moe_skinny_tile"): lambda: _moe_tile(1, 5)},
           "moe-k2": {("gptoss_fp8.kernels.moe_gemv", "moe_skinny_tile"): lambda: _moe_tile(2, 3)},
           "moe-k4": {("gptoss_fp8.kernels.moe_gemv", "moe_skinny_tile"): lambda: _moe_tile(4, 2)}}


@contextlib.contextmanager
def _patched(name: str):
    saved = []
    for (mod, attr), make in PATCHES.get(name, {}).items():
        m = importlib.import_module(mod)
        saved.append((m, attr, getattr(m, attr)))
        setattr(m, attr, make())
    try:
        yield
    finally:
        for m, attr, value in saved:
            setattr(m, attr, value)


def _replay_us(graphs: DecodeGraphs, cache, tokens, context: int) -> float:
    set_context(cache, context)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    graphs.step(cache, tokens)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="20b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", default="1")
    p.add_argument("--context", default="8192")
    p.add_argument("--variants", default="default,wgmma")
    p.add_argument("--replays", type=int, default=200)
    a = p.parse_args()
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    cfg = preset_config(a.model, a.layers)
    model = random_model(cfg, "cuda")
    base = KernelConfig()
    runners = {n: DecodeGraphs(model, TritonOps(config=replace(base, **VARIANTS[n]))) for n in names}
    for context in [int(c) for c in a.context.split(",")]:
        for batch in [int(b) for b in a.batch.split(",")]:
            cache = synthetic_cache(model, batch, context, context + 1)
            tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
            logits = {}
            for n, g in runners.items():  # capture (compiles), then keep the logits of one step
                set_context(cache, context)
                with _patched(n):
                    logits[n] = g.step(cache, tokens).clone()
            for _ in range(30):  # warm-up
                for g in runners.values():
                    _replay_us(g, cache, tokens, context)
            times: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(a.replays):
                for n, g in runners.items():
                    times[n].append(_replay_us(g, cache, tokens, context))
            floor_us = floor_bytes(cfg, batch, context)["total"] / HBM_BPS * 1e6
            ref = logits[names[0]].float()
            for n in names:
                us = statistics.median(times[n])
                diff = ((logits[n].float() - ref).norm() / ref.norm()).item()
                print(f"{a.model} L{cfg.num_hidden_layers} b={batch} ctx={context} | {n:>11}: {us:8.1f} us "
                      f"(min {min(times[n]):.1f}), floor/ours {floor_us / us:.2f} | logits vs {names[0]} rel {diff:.2e}",
                      flush=True)
            del cache
            runners = {n: DecodeGraphs(model, g.ops) for n, g in runners.items()}  # drop the case's graphs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

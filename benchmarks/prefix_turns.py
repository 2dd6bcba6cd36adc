"""What the prefix cache saves: the time to the first token of a conversation's next turn, with and without it.

On a synthetic model (random weights, ``bench prefill``'s ``random_model``; kernels mode, decode steps as CUDA
graphs), for each earlier prompt length N: a request of N tokens runs (1 token out), then a next turn of N + NEW tokens
that starts with it, timed from ``add`` to its first token, on an engine with the prefix cache (restored in place: the
first request's slot is free) and on one without (the whole prompt prefilled), both in this process. Then the copy
path: the next turn arrives while the first request still decodes, so its keys are copied from that slot. Then a
shared part: a prompt of the same N tokens with another NEW-token ending (a document asked about again), its full
layers' rows reused in place and its rings rebuilt (``ModelRunner.rebuild`` tokens prefilled again).

    python benchmarks/prefix_turns.py --model 20b --lengths 2048,8192,32768 --new 256

Prints one row per length: cold / in place / copied / shared-part ms, and the ratio. ``--profile N``: then one in-place next turn
after N tokens under torch.profiler: wall time, the GPU's kernel time, the host's device syncs, and the ops and
kernels that cost most (where the floor of a short chunk goes).
"""

from __future__ import annotations

import argparse
import time

import torch

from gptoss_fp8.bench.prefill import check_fits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.runtime.engine import Engine
from gptoss_fp8.runtime.prefix import MIN_SHARED
from gptoss_fp8.runtime.runner import ModelRunner
from gptoss_fp8.runtime.sampling import SamplingParams
from gptoss_fp8.verify.backends import ops_for


def first_token_s(engine: Engine, prompt: list[int]) -> float:
    """Seconds from add to the request's first token (the engine otherwise idle but for running decodes)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq = engine.add(prompt, SamplingParams(max_tokens=1))
    while not seq.tokens:
        engine.step()
    dt = time.perf_counter() - t0
    engine.run_until_done()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="20b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--new", type=int, default=256, help="tokens the next turn adds")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: the weights mode, a smoke run of this script")
    ap.add_argument("--profile", type=int, default=0, help="then profile one in-place next turn after this many tokens")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = preset_config(a.model, layers=a.layers)
    if a.device == "cuda":
        check_fits(cfg, a.model)
    model = random_model(cfg, a.device)
    ops = ops_for("kernels" if a.device == "cuda" else "weights")
    ctx = max(lengths) + a.new + 64
    warm = Engine(ModelRunner(model, ops, 3, ctx, prefix_cache=True), chunk=a.chunk)
    cold = Engine(ModelRunner(model, ops, 3, ctx), chunk=a.chunk)
    for eng in (warm, cold):
        eng.runner.capture_all()
    g = torch.Generator().manual_seed(0)
    rebuild = warm.prefix.rebuild
    print(f"# {a.model} ({cfg.num_hidden_layers} layers, random weights), {ops.name}, chunk {a.chunk}, next turn +{a.new} "
          f"tokens; a shared part's ring rebuild {rebuild} tokens; ms to the first token, median of {a.runs}")
    print("| earlier prompt | cold | in place | copied | shared part | cold / in place |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in [lengths[0]] + lengths:  # (the first length twice: its first pass warms the kernels up)
        times = {"cold": [], "place": [], "copy": [], "shared": []}
        skip = 0
        before = warm.metrics.cached_tokens
        for _ in range(a.runs):
            p1, q1 = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for _ in range(2))
            more = torch.randint(0, cfg.vocab_size, (a.new,), generator=g).tolist()
            first_token_s(cold, p1)
            times["cold"].append(first_token_s(cold, p1 + more))
            first_token_s(warm, p1)
            times["place"].append(first_token_s(warm, p1 + more))  # p1's slot is free: restored in place
            busy = warm.add(q1, SamplingParams(max_tokens=64))
            while not busy.tokens:
                warm.step()
            times["copy"].append(first_token_s(warm, q1 + more))  # q1's slot still decodes: its rows copied
            r1 = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
            first_token_s(warm, r1 + [(t + 1) % cfg.vocab_size for t in more])
            times["shared"].append(first_token_s(warm, r1 + more))  # r1's slot free: in place, its rings rebuilt
            if rebuild is not None and n - rebuild >= MIN_SHARED:
                skip += n - rebuild
        got = warm.metrics.cached_tokens - before
        assert got == 2 * n * a.runs + skip, f"a next turn did not reuse what it could ({got} cached)"
        ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"| {n} | {ms['cold']:.1f} | {ms['place']:.1f} | {ms['copy']:.1f} | {ms['shared']:.1f} | "
              f"{ms['cold'] / ms['place']:.1f}x |", flush=True)
    if a.profile:
        profile_turn(warm, cfg, a.profile, a.new, g)


def profile_turn(engine: Engine, cfg, n: int, new: int, g: torch.Generator, top: int = 18) -> None:
    """One in-place next turn after n tokens under torch.profiler: where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    p1 = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    more = torch.randint(0, cfg.vocab_size, (new,), generator=g).tolist()
    first_token_s(engine, p1)
    first_token_s(engine, p1 + more)  # (warm: this length's shapes once)
    first_token_s(engine, p1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        wall = first_token_s(engine, p1 + more)
    ev = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in ev if any(s in e.key for s in ("Synchronize", "DtoH", "item", "_local_scalar"))}
    launches = sum(e.count for e in ev if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx"))
    print(f"\n# profile: next turn +{new} after {n} tokens, in place: wall {1e3 * wall:.1f} ms (under the profiler), "
          f"GPU kernels {gpu_us / 1e3:.1f} ms, {launches} launches; syncs / reads {syncs}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top))


if __name__ == "__main__":
    main()

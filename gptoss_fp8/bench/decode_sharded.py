"""``gptoss-fp8 bench decode --tp T --ep E``: one decode step of the sharded model (issue 25).

One process per rank, each on its own GPU, all-reducing over NCCL; started for the user
(``launch_ranks``: RANK / WORLD_SIZE set as torchrun does), or under ``torchrun --nproc-per-node T``
(each rank runs its part, rank 0 prints and returns the rows). On CPU, or when ranks share a GPU,
the collectives are gloo's: the mechanics run, the figures mean nothing and every row says so.

What runs, per (context, batch) case: ``GptOss.decode_step`` of rank ``r`` (the model's own code,
the ``triton`` ops backend; the ``w8a8`` CPU spec on CPU) for B sequences that each hold
``context`` tokens, exactly as bench/decode.py runs the one-GPU step, on the rank's shard:
* weights: random FP8 at the real shapes of the rank's shard (bench/prefill.py ``random_model``
  with ``par``: tensors every rank holds whole are equal on every rank, shards differ);
* the KV cache: the rank's own kv heads only (``model.new_cache``), filled synthetically as the
  one-GPU bench fills it (bench/decode.py ``synthetic_cache``: random bf16 K / V, ``lengths =
  context``, reset before every step; the values are not a slice of one unsharded cache, which
  the timing does not see);
* the token ids: the same on every rank (made on rank 0's seed and broadcast).
With NCCL (one GPU per rank) each case's step is captured as a CUDA graph on every rank
(model/graph.py ``DecodeGraphs``: the all-reduces are captured with the GEMMs) and replayed; with
gloo, eager ``decode`` steps (a graph cannot capture a reduction through host memory).

Timing: every step starts behind a barrier (devices synchronized, then ``dist.barrier``, outside
the timed region); each rank times its step (CUDA events around the replay on a GPU, the host
clock on CPU), so rank 0's time includes its waits for the other ranks inside the all-reduces.
``ms_per_step`` is rank 0's median, ``slowest_rank_ms_per_step`` the largest rank median. The
warm-up is ``warmup`` steps and, on a GPU, enough more for ``WARMUP_S`` at the slowest rank's
pace: the same count on every rank (a step holds collectives, so the ranks must step together).

Figures (per row): tokens/s per user (1 / step) and total (B / step); $ per 1M output tokens
counting all T GPUs at ``GPU_HOUR_USD`` per GPU-hour; the per-rank HBM floor
(``floor_bytes_rank``: the bytes ONE rank must read in the step, at ``HBM_BPS``: its shard of the
touched experts, its attention shard, the replicated router / norms, the lm_head (or its vocabulary slice) and embedding rows,
its kv heads' keys and values) and floor / ours; the cache bytes per rank; and the breakdown of
one extra eager step by part on rank 0 (bench/prefill.py ``TimedOps``, the all-reduces as their
own part, ``allreduce``, and with vocab-parallel the logits' ``allgather``). A case whose cache
does not fit a rank's GPU beside the weights is skipped on every rank, with a line saying so.

No seed column: the seed has no decode figures per layout (its notes only say EP4 TP4 was its
best layout for decode).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from gptoss_fp8.bench.decode import HBM_BPS, HEADROOM, WARMUP_S, floor_bytes, time_once
from gptoss_fp8.config import GptOssConfig, preset_config
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import (
    Parallel,
    check_layout,
    check_torchrun_world,
    device_for,
    run_job,
    start_rank,
    under_torchrun,
)

MAX_WARMUP_STEPS = 2000


def floor_bytes_rank(cfg: GptOssConfig, par: Parallel, batch: int, context: int) -> dict[str, float]:
    """Bytes ONE rank (``par``) must read from HBM in a decode step of ``batch`` sequences at
    ``context`` cached tokens, by part, and their ``total`` (bench/decode.py ``floor_bytes`` on
    that rank's own tensors: tp = 1 gives the one-GPU floor exactly)."""
    return floor_bytes(cfg, batch, context, par)


def bench_decode_sharded(preset: str, batches: list[int], contexts: list[int], tp: int, ep: int,
                         layers: int | None = None, runs: int = 20, warmup: int = 3, seed: int = 0, echo=print,
                         device: str = "cuda", kernel_config=None, timeout_s: float = 3600.0,
                         vocab_parallel: bool = False) -> list[dict]:
    """One row per (context, batch) (rank 0's; module docstring). Under torchrun this process is
    one rank (rank 0 prints as it goes and returns the rows, the others get ``[]``); otherwise
    ``tp`` rank processes are started, and their lines printed and rows returned when they end.
    ``kernel_config``: of a given config only its GEMM library reaches the ranks (each builds
    TritonOps' default config with it). ``device="cpu"``: gloo and the CPU spec, for tests."""
    cfg = preset_config(preset, layers)
    check_layout(cfg, tp, ep, vocab_parallel)
    for option, values in (("--batch", batches), ("--context", contexts)):
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise GptOssFp8Error(f"{option} {values!r}: give one or more positive integers")
    if runs < 1 or warmup < 0:
        raise GptOssFp8Error(f"runs {runs} / warmup {warmup}: give runs >= 1 and warmup >= 0")
    device_for(device, 0)  # no GPU for --device cuda: one line here, before any rank starts
    job = {"preset": preset, "batches": list(batches), "contexts": list(contexts), "tp": tp, "ep": ep,
           "layers": layers, "runs": runs, "warmup": warmup, "seed": seed, "device": device,
           "gemm": None if kernel_config is None else kernel_config.gemm, "vocab_parallel": vocab_parallel}
    if under_torchrun():
        check_torchrun_world(tp)
        return run_rank(job, echo=echo) or []
    out = run_job("gptoss_fp8.bench.decode_sharded", job, tp, "sharded decode bench", timeout_s)
    for line in out["lines"]:
        echo(line)
    return out["rows"]


def run_rank(job: dict, echo=print) -> list[dict] | None:
    """This rank's part of the bench (process group from RANK / WORLD_SIZE / MASTER_*): rank 0's rows."""
    import torch.distributed as dist

    from gptoss_fp8.bench.decode import _breakdown, set_context, synthetic_cache
    from gptoss_fp8.bench.prefill import GPU_HOUR_USD, check_fits, random_model, usd_per_million_tokens
    from gptoss_fp8.bench.prefill_sharded import rank_ops
    from gptoss_fp8.model.cache import KVCache

    tp, ep = int(job["tp"]), int(job["ep"])
    rank, dev = start_rank(job["device"], tp)
    cuda = dev.startswith("cuda")
    try:
        collective = dist.get_backend()
        shared_gpu = cuda and torch.cuda.device_count() < tp
        graphed = cuda and collective == "nccl"
        sharers = math.ceil(tp / torch.cuda.device_count()) if shared_gpu else 1  # ranks on one GPU
        reduce_dev = dev if collective == "nccl" else "cpu"  # NCCL reduces device tensors only

        def slowest(values: list[float]) -> list[float]:
            t = torch.tensor(values, dtype=torch.float64, device=reduce_dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()

        lines: list[str] = []

        def say(line: str) -> None:
            if rank == 0:
                lines.append(line)
                echo(line)

        par = Parallel(rank=rank, tp=tp, ep=ep, vocab_parallel=bool(job["vocab_parallel"]))
        vp = par.vocab_parallel
        preset = job["preset"]
        cfg = preset_config(preset, job["layers"])
        full_layers = preset_config(preset).num_hidden_layers
        if cuda:
            check_fits(cfg, f"{preset} with {cfg.num_hidden_layers} layers", dev, par, sharers)
        t0 = time.perf_counter()
        model = random_model(cfg, dev, job["seed"], par)
        ops = rank_ops(dev, job["gemm"], model)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        dist.barrier()
        how = "CUDA-graph replay" if graphed else f"eager steps over {collective}: not a measurement"
        note = ", ranks share a GPU" if shared_gpu else ""
        mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB resident per rank" if cuda else ""
        say(f"# {preset} tp {tp} ep {ep}{' vocab-parallel' if vp else ''} ({collective}{note}): "
            f"{cfg.num_hidden_layers} of {full_layers} layers, random FP8 weights per rank on "
            f"{torch.cuda.get_device_name() if cuda else 'cpu'} in {time.perf_counter() - t0:.1f} s{mem}; "
            f"KV cache random bf16 (no prefill), {how}")
        if graphed:
            from gptoss_fp8.model.graph import DecodeGraphs

            graphs = DecodeGraphs(model, ops)
        n_kv = model.model.layers[0].self_attn.n_kv
        windows = [layer.window for layer in model.model.layers]
        rows = []
        for context in job["contexts"]:
            for batch in job["batches"]:
                max_len = context + 1  # the step writes row ``context`` (lengths reset before each step)
                need = KVCache.bytes_for(windows, n_kv, cfg.head_dim, max_len, batch)
                base = {"model": preset, "layers": cfg.num_hidden_layers, "full_layers": full_layers, "batch": batch,
                        "context": context, "tp": tp, "ep": ep, "gpus": tp, "vocab_parallel": vp,
                        "collective": collective, "shared_gpu": shared_gpu, "graph": graphed, "measurement": graphed,
                        "device": torch.cuda.get_device_name() if cuda else "cpu", "cache_bytes": need}
                if cuda:  # every rank skips, or none: the steps hold collectives
                    short = slowest([need * sharers + HEADROOM - torch.cuda.mem_get_info()[0]])[0]
                    if short > 0:
                        row = {**base, "skipped": f"the cache needs {need / 2**30:.1f} GiB per rank, "
                                                  f"{short / 2**30:.1f} GiB more than a rank's GPU has free beside "
                                                  f"the weights ({HEADROOM / 2**30:.0f} GiB headroom)"}
                        rows.append(row)
                        say(format_row(row))
                        continue
                cache = synthetic_cache(model, batch, context, max_len, job["seed"])
                tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(
                    job["seed"] * 1_000_003 + 4099 * context + batch)).to(dev)
                dist.broadcast(tokens, 0)  # the same ids on every rank (already equal: made explicit)

                def reset(c=cache, n=context) -> None:
                    set_context(c, n)
                    sync()
                    dist.barrier()

                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                if graphed:
                    step = lambda c=cache, t=tokens: graphs.step(c, t)  # noqa: E731
                else:
                    step = lambda c=cache, t=tokens: model.decode(c, t, ops)  # noqa: E731
                times = _time_ranks(step, reset, job["runs"], job["warmup"], cuda, slowest)
                peak = torch.cuda.max_memory_allocated() if cuda else None
                step_s = statistics.median(times)
                floor = floor_bytes_rank(cfg, par, batch, context)
                floor_s = floor["total"] / HBM_BPS
                row = {**base, "ms_per_step": step_s * 1e3, "slowest_rank_ms_per_step": slowest([step_s])[0] * 1e3,
                       "tok_s_per_user": 1.0 / step_s, "tok_s_total": batch / step_s,
                       "usd_per_1m_tokens": usd_per_million_tokens(step_s, batch, GPU_HOUR_USD) * tp,
                       "floor_ms": floor_s * 1e3, "floor_ratio": floor_s / step_s, "floor_bytes": floor,
                       "runs_s": times, "peak_mem_bytes": peak,
                       **_breakdown(model, cache, tokens, ops, reset, cfg.num_local_experts, cuda)}
                rows.append(row)
                say(format_row(row))
                del cache, reset, step, tokens  # they hold the cache: free it before the next case's check
                if graphed:
                    graphs = DecodeGraphs(model, ops)  # drop the case's graph and its pool
                    torch.cuda.empty_cache()
        if rank == 0 and job.get("result"):
            Path(job["result"]).write_text(json.dumps({"lines": lines, "rows": rows}, indent=1))
        dist.barrier()
        return rows if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _time_ranks(step, reset, runs: int, warmup: int, cuda: bool, slowest) -> list[float]:
    """Seconds of each of ``runs`` calls of ``step`` on this rank, ``reset()`` (untimed: lengths
    back, then the barrier) before each; after ``warmup`` calls (at least one: the first captures
    the graph) and, on a GPU, as many more as make ``WARMUP_S`` of calls after the first at the
    slowest rank's pace (``slowest``: the max over ranks), so every rank makes the same number."""
    reset()
    step()
    n = max(warmup - 1, 1 if cuda else 0)
    t0 = time.perf_counter()
    for _ in range(n):
        reset()
        step()
    if cuda:
        spent = slowest([time.perf_counter() - t0])[0]
        more = min(MAX_WARMUP_STEPS - n, math.ceil(max(0.0, WARMUP_S - spent) * n / max(spent, 1e-9)))
        for _ in range(max(more, 0)):
            reset()
            step()
    times = []
    for _ in range(runs):
        reset()
        times.append(time_once(step, cuda))
    return times


def format_row(r: dict) -> str:
    head = (f"{r['model']} L{r['layers']} tp {r['tp']} ep {r['ep']}{' vp' if r.get('vocab_parallel') else ''} "
            f"b={r['batch']} ctx={r['context']}")
    if r.get("skipped"):
        return f"{head}: skipped ({r['skipped']})"
    how = "CUDA graph" if r["graph"] else "eager"
    line = (f"{head} ({r['collective']}, {how}): {r['ms_per_step']:.3f} ms/step (slowest rank "
            f"{r['slowest_rank_ms_per_step']:.3f}), {r['tok_s_per_user']:.0f} tok/s/user, {r['tok_s_total']:.0f} tok/s "
            f"total, ${r['usd_per_1m_tokens']:.3f}/1M tok on {r['gpus']} GPUs; floor per rank {r['floor_ms']:.3f} ms "
            f"({r['floor_bytes']['total'] / 1e9:.2f} GB at {HBM_BPS / 1e12:.2f} TB/s), floor/ours {r['floor_ratio']:.2f}; "
            f"cache {r['cache_bytes'] / 2**30:.2f} GiB per rank")
    if not r["measurement"]:
        line += " | NOT A MEASUREMENT (" + ("ranks share one GPU" if r["shared_gpu"] else r["device"]) + \
            f", {r['collective']}, eager steps)"
    parts = r["parts_s"]
    shown = " | ".join(f"{p} {parts[p] * 1e3:.3f} ms" for p in ("attention", "moe", "dense", "norm", "allreduce", "allgather")
                       if p in parts)
    return (line + f"\n  one eager step by part, rank 0 (device time of its ops calls): {shown} | sum "
            f"{sum(parts.values()) * 1e3:.3f} ms; eager wall {r['eager_step_s'] * 1e3:.3f} ms")


if __name__ == "__main__":  # a rank started by bench_decode_sharded
    import sys

    run_rank(json.loads(Path(sys.argv[1]).read_text()))

"""``gptoss-fp8 bench prefill --tp T --ep E``: batch-1 prefill latency of the sharded model (issue 25).

One process per rank, each on its own GPU, all-reducing over NCCL (gloo on CPU, or when ranks share
a GPU: the mechanics run, the figures then mean nothing and the row says so). Started for the user
(``launch_ranks``: RANK / WORLD_SIZE set as torchrun does), or under ``torchrun --nproc-per-node T``
(each rank runs its part, rank 0 prints).

Latency is the one-GPU definition: prompt in, last-position logits out on rank 0. Every run starts
behind a barrier (all ranks hold the same token ids, broadcast from rank 0), and the figure is rank
0's time to its logits; the slowest rank's time is reported beside it. Weights: random per rank at
the real shapes of the rank's shard (``random_model(par=...)``: replicated tensors equal on every
rank), or a converted checkpoint's tp/ep layout. The breakdown (one extra run, rank 0's events)
adds the all-reduces as their own part. $ per 1M input tokens counts all T GPUs at $3 per GPU-hour.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from gptoss_fp8.config import preset_config
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.parallel import Parallel, check_layout, check_torchrun_world, run_job, start_rank, under_torchrun

# The seed's batch-1 prefill on one node (issue 25), seconds, by (tp, ep) and prompt length.
SEED_SHARDED_S = {
    "20b": {(2, 2): {8192: 0.127, 128000: 8.143}, (4, 4): {8192: 0.108, 128000: 4.766},
            (8, 8): {8192: 0.116, 128000: 3.365}},
    "120b": {(2, 2): {8192: 0.190, 128000: 12.116}, (4, 4): {8192: 0.165, 128000: 7.165},
             (8, 8): {8192: 0.179, 128000: 5.119}},
}
TARGET_VS_SEED = 1.5  # issue 25: at least 1.5x faster than the seed's row


def bench_sharded(preset: str, token_list: list[int], tp: int, ep: int, layers: int | None = None, runs: int = 5,
                  warmup: int = 2, moe_chunk: int | None = None, seed: int = 0, echo=print, checkpoint: Path | None = None,
                  device: str = "cuda", kernel_config=None, timeout_s: float = 3600.0,
                  vocab_parallel: bool = False, cuda_graph: bool = False, attention: str = "bf16",
                  full_last_layer: bool = False) -> list[dict]:
    """One row per prompt length (rank 0's). Under torchrun this process is one rank (the other
    ranks get ``[]``); otherwise ``tp`` rank processes are started and their rows returned.
    ``cuda_graph``: also the same prefill as a CUDA graph on every rank (NCCL only)."""
    if checkpoint is None:
        check_layout(preset_config(preset, layers), tp, ep, vocab_parallel)
    job = {"preset": preset, "tokens": token_list, "tp": tp, "ep": ep, "vocab_parallel": vocab_parallel,
           "cuda_graph": cuda_graph, "full_last_layer": full_last_layer,
           "layers": layers, "runs": runs, "warmup": warmup, "moe_chunk": moe_chunk, "seed": seed, "device": device,
           "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
           # the ranks build TritonOps' default config; of a given one, its GEMM and attention libraries are passed on
           "gemm": None if kernel_config is None else kernel_config.gemm, "attention": attention,
           "attention_backend": "ours" if kernel_config is None else kernel_config.attention_backend}
    if under_torchrun():
        check_torchrun_world(tp)
        rows = run_rank(job, echo=echo) or []  # rank 0's (the other ranks have none)
    else:
        rows = run_job("gptoss_fp8.bench.prefill_sharded", job, tp, "sharded prefill bench", timeout_s)
    for r in rows:
        echo(format_sharded_row(r))
    return rows


def rank_ops(dev: str, gemm: str | None, model, attention_backend: str = "ours"):
    """A rank's ops backend: ``triton`` (with ``gemm``'s library when given, and
    ``attention_backend``'s) on a GPU, the w8a8 spec on CPU. For ``gemm="deep_gemm"`` the model's
    weights become their K-padded copies first (kernels/deepgemm.py ``adopt_padded``)."""
    if gemm == "deep_gemm":
        from gptoss_fp8.kernels.deepgemm import adopt_padded

        adopt_padded(model)
    if dev.startswith("cuda"):
        from dataclasses import replace

        from gptoss_fp8.model.triton_ops import TritonOps, default_config

        return TritonOps(config=replace(default_config(), gemm=gemm or "ours", attention_backend=attention_backend))
    from gptoss_fp8.model.ops import W8A8CpuOps  # CPU: the mechanics on the w8a8 spec (tests)

    return W8A8CpuOps()


def run_rank(job: dict, echo=print) -> list[dict] | None:
    """This rank's part of the bench (process group from RANK / WORLD_SIZE / MASTER_*): rank 0's rows."""
    import torch.distributed as dist

    from gptoss_fp8.bench.prefill import (
        SEED_S,
        TimedOps,
        full_depth_estimate,
        last_layer_rows,
        matching_preset,
        part_flops,
        prefill_logits,
        random_model,
        usd_per_million_tokens,
    )

    tp, ep = int(job["tp"]), int(job["ep"])
    rank, dev = start_rank(job["device"], tp)
    cuda = dev.startswith("cuda")
    try:
        collective = dist.get_backend()
        shared_gpu = cuda and torch.cuda.device_count() < tp
        # random weights: the asked layout; a checkpoint's own layout decides (load_model)
        par = Parallel(rank=rank, tp=tp, ep=ep, vocab_parallel=bool(job.get("vocab_parallel")))
        t0 = time.perf_counter()
        if job["checkpoint"]:
            from gptoss_fp8.checkpoint.checkpoint import Checkpoint
            from gptoss_fp8.model.load import load_model

            if job["layers"] is not None:
                raise GptOssFp8Error("--layers builds random weights at a preset's shapes; "
                                     "with --checkpoint the whole model runs")
            ckpt = Checkpoint.open(job["checkpoint"])
            ckpt.resolve_layout(tp, ep)
            model = load_model(ckpt, par, dev)
            cfg = model.cfg
            preset = matching_preset(cfg) or Path(job["checkpoint"]).name
        else:
            preset = job["preset"]
            cfg = preset_config(preset, job["layers"])
            model = random_model(cfg, dev, job["seed"], par)
        full_cfg = preset_config(preset) if preset in SEED_S else cfg
        full_layers = full_cfg.num_hidden_layers
        last_layer = last_layer_rows(model, bool(job.get("full_last_layer")), cfg.num_hidden_layers == full_layers)
        ops = rank_ops(dev, job["gemm"], model, job.get("attention_backend", "ours")).with_attention(
            job.get("attention", "bf16"))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        dist.barrier()
        if rank == 0:
            mem = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
            note = ", ranks share a GPU: figures not meaningful" if shared_gpu else ""
            echo(f"# {preset} tp {tp} ep {ep} ({collective}{note}): "
                 f"{cfg.num_hidden_layers} of {full_layers} layers in {time.perf_counter() - t0:.1f} s, "
                 f"{mem:.1f} GiB resident per rank")
        rows = []
        for n in job["tokens"]:
            tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(job["seed"] + n))
            tokens = tokens.to(dev)
            dist.broadcast(tokens, 0)  # the same prompt on every rank (already equal: made explicit)

            def once(o=ops, tokens=tokens) -> float:
                sync()
                dist.barrier()
                s = time.perf_counter()
                prefill_logits(model, tokens, o, job["moe_chunk"])
                sync()
                return time.perf_counter() - s

            for _ in range(max(job["warmup"], 1)):
                once()
            times = [once() for _ in range(job["runs"])]
            # NCCL reduces device tensors only (gloo takes either); both reduce float64
            slowest = torch.tensor(times, dtype=torch.float64, device=dev if collective == "nccl" else "cpu")
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            timed = TimedOps(ops, cfg.num_local_experts, cuda=cuda)  # the router: all experts
            total = once(timed)
            parts = timed.seconds()
            parts["other"] = max(total - sum(parts.values()), 0.0)
            lat = statistics.median(times)
            # (less the whole model's pruned last layer, as bench prefill: a cut model runs its last layer on every row)
            est, saving = full_depth_estimate(lat, total, parts, timed.attention_by_layer_kind(), cfg.num_hidden_layers,
                                              full_cfg, bool(job.get("full_last_layer")))
            graph = _graph_timing(model, tokens, ops, job, collective, sync, dist) if job.get("cuda_graph") else {}
            if graph.get("graph_latency_s"):
                g = graph["graph_latency_s"]
                graph["graph_est_full_s"] = g * full_layers / cfg.num_hidden_layers - saving * g / lat
            seed_s = SEED_SHARDED_S.get(preset, {}).get((tp, ep), {}).get(n)
            flops = part_flops(cfg, n, model.prune_last_layer)
            rows.append({
                "model": preset, "tokens": n, "tp": tp, "ep": ep, "vocab_parallel": model.par.vocab_parallel,
                "gpus": tp, "collective": collective,
                "shared_gpu": shared_gpu, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "layers": cfg.num_hidden_layers, "full_layers": full_layers, "last_layer": last_layer,
                "latency_s": lat, "runs_s": times, "slowest_rank_median_s": statistics.median(slowest.tolist()),
                "est_full_s": est, "est_pruned_saving_s": saving, "usd_per_1m_tokens": usd_per_million_tokens(est, n) * tp,
                "seed_s": seed_s, "vs_seed": seed_s / est if seed_s else None,
                "target_s": seed_s / TARGET_VS_SEED if seed_s else None,
                "one_gpu_seed_s": SEED_S.get(preset, {}).get(n),
                "parts_s": parts, "parts_total_s": total, "flops": flops,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, **graph,
            })
        if rank == 0 and job.get("result"):
            Path(job["result"]).write_text(json.dumps(rows, indent=1))
        dist.barrier()
        return rows if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _graph_timing(model, tokens, ops, job: dict, collective: str, sync, dist) -> dict:
    """``--cuda-graph``: the same prefill captured as a CUDA graph on every rank (bench/prefill.py
    ``GraphedPrefill``; its all-reduces NCCL calls inside the graph) and replayed behind a barrier
    as the eager runs are -> rank 0's median and runs; with gloo (CPU, ranks sharing a GPU) a note:
    a reduction through host memory cannot be captured."""
    if collective != "nccl":
        return {"graph_note": f"not run: {collective} reduces through host memory, which a CUDA graph cannot capture"}
    from gptoss_fp8.bench.prefill import GraphedPrefill

    torch.cuda.empty_cache()  # the graph allocates its own pool
    graphed = GraphedPrefill(model, tokens.shape[0], ops, job["moe_chunk"])

    def replay(g=graphed) -> float:
        sync()
        dist.barrier()
        s = time.perf_counter()
        g(tokens)
        sync()
        return time.perf_counter() - s

    for _ in range(max(job["warmup"], 1)):
        replay()
    times = [replay() for _ in range(job["runs"])]
    del graphed, replay  # the graph's pool goes with them
    torch.cuda.empty_cache()
    return {"graph_latency_s": statistics.median(times), "graph_runs_s": times}


def format_sharded_row(r: dict) -> str:
    from gptoss_fp8.bench.prefill import est_text

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    vp = " vocab-parallel" if r.get("vocab_parallel") else ""
    head = (f"{r['model']} | tp {r['tp']} ep {r['ep']}{vp} ({r['collective']}) | {r['tokens']} tok | "
            f"layers {r['layers']}/{r['full_layers']} | latency {r['latency_s']:.4f} s (slowest rank "
            f"{r['slowest_rank_median_s']:.4f})" + est_text(r)
            + f" | ${r['usd_per_1m_tokens']:.4f}/1M tok on {r['gpus']} GPUs | seed {f(r['seed_s'])} s "
            f"(x{f(r['vs_seed'], '{:.2f}')}; target {f(r['target_s'])} s)"
            + (" | RANKS SHARE ONE GPU: not a measurement" if r["shared_gpu"] else "")
            + (f" | CUDA graph {r['graph_latency_s']:.4f} s (full-model est {r['graph_est_full_s']:.4f} s)"
               if r.get("graph_latency_s") else f" | CUDA graph {r['graph_note']}" if r.get("graph_note") else ""))
    tot = r["parts_total_s"]
    parts = " | ".join(f"{p} {r['parts_s'].get(p, 0) * 1e3:.2f} ms ({100 * r['parts_s'].get(p, 0) / tot:.0f}%)"
                       for p in ("attention", "moe", "dense", "norm", "allreduce", "allgather", "other")
                       if p != "allgather" or p in r["parts_s"])
    return head + f"\n  breakdown, rank 0 ({tot * 1e3:.2f} ms): " + parts


if __name__ == "__main__":  # a rank started by bench_sharded
    import sys

    run_rank(json.loads(Path(sys.argv[1]).read_text()))

"""``gptoss-fp8 bench decode``: one decode step of a batch of B sequences at a given context, on
our kernels, replayed as a CUDA graph (model/graph.py), beside the HBM floor of that step.

What runs: ``GptOss.decode_step`` (the model's own code, the ``triton`` ops backend) for B
sequences that each hold ``context`` tokens, captured once per (batch, context) case and replayed;
the time is the median over replays of one step (token ids in, logits [B, V] out), CUDA events
around each replay. Weights: random FP8 at the preset's real shapes built on the GPU as
``bench prefill`` builds them (bench/prefill.py ``random_model``; routing over random weights is
about even). The KV cache is filled synthetically: random bf16 K / V (N(0, 1)) in every row and
``lengths = context`` for every sequence, no prefill run (the step reads the same bytes and does
the same work as after a real prompt; only the attention weights' values differ, which the
timing does not see). Before every step (outside the timed region) the lengths are set back
to ``context``, so every timed step reads exactly ``context`` cached tokens and writes row
``context``.

The floor (``floor_bytes``): bytes one step must read from HBM at least, at ``HBM_BPS``:
* the expert weights the batch touches: per layer, B tokens each pick top_k distinct experts of E
  uniformly (a trained router's skew not modelled), so E (1 - (1 - k/E)^B) distinct experts are
  expected, each its FP8 gate_up and down matrices with their scales and biases;
* attention weights (q / k / v / o FP8 + scales + biases + sinks), the router (bf16), the norms;
* the bf16 lm_head, and B rows of the embedding;
* the KV bytes read: per full layer B (context + 1) keys and values, per sliding layer
  B min(context + 1, window), bf16, kv heads x head_dim each.
Activations are ignored (a few MB). ``floor_ratio`` = floor / ours (1 = at the floor).

Cost: $ per 1M output tokens at ``GPU_HOUR_USD`` per GPU-hour = step seconds / B tokens.
A case whose cache does not fit beside the weights is skipped with a line saying so.

The transformers peer (issue 24: "transformers bf16 decode in the same run where it fits"; its
53 ms at batch 1): after our rows, our model and graphs are freed and transformers' bf16
``GptOssForCausalLM`` is built at the same shapes (same layers) with random weights
(bench/decode_peer.py, whose docstring has the details), then timed per case in each peer mode
(``peer_modes``, default both): ``eager``, its generate loop as it runs for gpt-oss's default cache
(its own chunked prefill of random prompts of ``context`` tokens into its own ``DynamicCache``,
untimed; up to 16384 tokens of whole prompts, their K / V rows copied over the rest of the batch;
single-token steps with ``eager`` attention, no CUDA graph), and ``compiled``, the peer at its best
(the same prefill into a ``StaticCache``, the one-token forward torch.compile'd with
``fullgraph=True`` and replayed as a CUDA graph; its compile, untimed, reported as ``compile_s``).
``torch.cuda.synchronize`` around each step, ``time.perf_counter``, median of ``peer_steps`` after 5
untimed ones (compiled: at least 3). Unlike ours, its cache grows by one token a step (context ->
context + 5 + peer_steps; ~25 tokens against 8192: negligible). Each of our rows gets
``peer_modes`` (per mode: its figures and ``speedup``, peer ms / ours ms, or ``failed``: out of
memory, estimated before the prefill or met, or a failure inside transformers or torch.compile)
and, from the faster mode that ran, ``peer_mode``, ``peer_ms_per_step``, ``peer_tok_s_per_user``
and ``speedup_vs_peer`` (same layers on both sides), or ``peer_failed`` when no mode ran. Only for
20b on a GPU with transformers importable (it is not a dependency; a line says why not): the 120b
does not fit one GPU in bf16 (234 GB of weights), so it has no peer.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from gptoss_fp8.bench.prefill import (
    GPU_HOUR_USD,
    check_distinct_layers,
    distinct_text,
    random_model,
    repeated_text,
    usd_per_million_tokens,
)
from gptoss_fp8.config import GptOssConfig, preset_config
from gptoss_fp8.model.cache import KVCache
from gptoss_fp8.model.gptoss import GptOss, local_heads
from gptoss_fp8.parallel import SINGLE, Parallel

HBM_BPS = 4.26e12  # H200 HBM3e, bytes/s (issue 24's floor)
WARMUP_S = 1.0
HEADROOM = 2 << 30  # bytes left free beside the cache: activations, logits, the graph pool


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts among ``batch`` tokens' top-k picks (each token: k distinct of E,
    uniformly at random): E (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def floor_bytes(cfg: GptOssConfig, batch: int, context: int, par: Parallel = SINGLE) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences at ``context`` cached tokens must read, by part
    (module docstring), from the model's own tensor list, and their sum as ``total``.

    ``par``: what one rank of a sharded model must read (bench/decode_sharded.py), from that rank's
    own tensors (``GptOss(cfg, par).expected()``): its heads' attention shard; its expert group's
    experts, of which the batch touches ``touched / ep`` on average (each of the E experts is
    touched with the same probability), each at its own intermediate part; the replicated router,
    norms and lm_head (or its vocabulary rows, and its share of the batch's embedding rows); its kv
    heads' keys and values. The default (one GPU) is the whole model."""
    parts = dict.fromkeys(("experts", "attention", "router_norms", "lm_head", "embedding", "kv"), 0.0)
    touched = expected_experts(cfg.num_local_experts, cfg.num_experts_per_tok, batch)
    for name, (shape, dtype) in GptOss(cfg, par, attn_fp8=True).expected().items():
        n = math.prod(shape) * dtype.itemsize
        if ".mlp.experts." in name:  # a rank's E / ep experts, touched / ep of them: n / (E / ep) * touched / ep
            parts["experts"] += n / cfg.num_local_experts * touched
        elif ".self_attn." in name:
            parts["attention"] += n
        elif name == "lm_head.weight":
            parts["lm_head"] += n
        elif name == "model.embed_tokens.weight":
            # the batch's rows; a vocab-parallel rank reads those in its slice (its share on average)
            rows = batch if shape[0] == cfg.vocab_size else batch * shape[0] / cfg.vocab_size
            parts["embedding"] += rows * shape[-1] * dtype.itemsize
        else:  # router, norms
            parts["router_norms"] += n
    per_key = 2 * local_heads(cfg, par)[1] * cfg.head_dim * 2  # K and V of the rank's kv heads, bf16
    for kind in cfg.layer_types:
        keys = context + 1
        if kind == "sliding_attention" and cfg.sliding_window > 0:
            keys = min(keys, cfg.sliding_window)
        parts["kv"] += batch * keys * per_key
    parts["total"] = sum(parts.values())
    return parts


def cache_bytes(cfg: GptOssConfig, batch: int, max_len: int) -> int:
    windows = [cfg.sliding_window if t == "sliding_attention" else 0 for t in cfg.layer_types]
    return KVCache.bytes_for(windows, cfg.num_key_value_heads, cfg.head_dim, max_len, batch)


def synthetic_cache(model: GptOss, batch: int, context: int, max_len: int, seed: int = 0) -> KVCache:
    """A cache of ``batch`` sequences holding ``context`` tokens each: random bf16 K / V, N(0, 1)."""
    cache = model.new_cache(max_len, batch=batch)
    gen = torch.Generator(device=cache.lengths.device).manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.normal_(generator=gen)
    set_context(cache, context)
    return cache


def set_context(cache: KVCache, context: int) -> None:
    """Every sequence holds ``context`` tokens again (device lengths and host mirror)."""
    cache.lengths.fill_(context)
    cache.host_lengths = [context] * cache.batch


def row_figures(cfg: GptOssConfig, batch: int, context: int, step_s: float) -> dict:
    """The derived columns of one case: tokens/s, $/1M, floor and ratio."""
    floor = floor_bytes(cfg, batch, context)
    floor_s = floor["total"] / HBM_BPS
    return {
        "ms_per_step": step_s * 1e3,
        "tok_s_per_user": 1.0 / step_s,
        "tok_s_total": batch / step_s,
        "usd_per_1m_tokens": usd_per_million_tokens(step_s, batch, GPU_HOUR_USD),
        "floor_ms": floor_s * 1e3,
        "floor_ratio": floor_s / step_s,
        "floor_bytes": floor,
    }


def format_row(r: dict) -> str:
    if r.get("skipped"):
        return f"{r['model']} b={r['batch']} ctx={r['context']}: skipped ({r['skipped']})"
    rep = f" ({repeated_text(r['distinct_layers'])})" if r.get("distinct_layers") else ""
    return (f"{r['model']} L{r['layers']}{rep} b={r['batch']} ctx={r['context']}: {r['ms_per_step']:.3f} ms/step, "
            f"{r['tok_s_per_user']:.0f} tok/s/user, {r['tok_s_total']:.0f} tok/s total, "
            f"${r['usd_per_1m_tokens']:.3f}/1M tok; floor {r['floor_ms']:.3f} ms "
            f"({r['floor_bytes']['total'] / 1e9:.2f} GB at {HBM_BPS / 1e12:.2f} TB/s), floor/ours "
            f"{r['floor_ratio']:.2f}; cache {r['cache_bytes'] / 2**30:.2f} GiB"
            + (_format_parts(r) if r.get("parts_s") else ""))


def _format_parts(r: dict) -> str:
    parts = r["parts_s"]
    shown = " | ".join(f"{p} {parts[p] * 1e3:.3f} ms" for p in ("attention", "moe", "dense", "norm") if p in parts)
    return (f"\n  one eager step by part (device time of its ops calls): {shown} | sum "
            f"{sum(parts.values()) * 1e3:.3f} ms; eager wall {r['eager_step_s'] * 1e3:.3f} ms")


def _time_steps(step, reset, runs: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds of each of ``runs`` calls of ``step`` after ``warmup`` (and >= WARMUP_S on a GPU);
    ``reset()`` before each call, untimed."""
    w0, done = time.perf_counter(), 0
    while done < warmup or (cuda and time.perf_counter() - w0 < WARMUP_S and done < 2000):
        reset()
        step()
        done += 1
    times = []
    for _ in range(runs):
        reset()
        times.append(time_once(step, cuda))
    return times


def time_once(step, cuda: bool) -> float:
    """Seconds of one call of ``step``: CUDA events around it on a GPU (device time, the host not
    waited for before), the host clock on CPU."""
    if not cuda:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    step()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3


def _breakdown(model, cache, tokens, ops, reset, num_experts: int, cuda: bool) -> dict:
    """One eager step with every ops call timed by part (bench/prefill.py ``TimedOps``: CUDA events
    around each call, so device time per part; the eager step's wall time beside it, whose excess
    over the graph step is host launch time the graph removes)."""
    from gptoss_fp8.bench.prefill import TimedOps

    timed = TimedOps(ops, num_experts, cuda=cuda)
    reset()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model.decode(cache, tokens, timed)
    sync()
    wall = time.perf_counter() - t0
    reset()
    return {"parts_s": timed.seconds(), "eager_step_s": wall}


def bench(preset: str, batches: list[int], contexts: list[int], layers: int | None = None, runs: int = 20,
          warmup: int = 3, seed: int = 0, echo=print, device: str = "cuda", ops=None,
          kernel_config=None, peer: bool = True, peer_steps: int = 20,
          peer_modes: tuple[str, ...] | None = None, distinct_layers: int | None = None) -> list[dict]:
    """One row per (context, batch): ms per step (median), tokens/s, $/1M, floor, cache bytes;
    with ``peer`` (20b on a GPU) the transformers peer's step beside it, in ``peer_modes`` (None:
    both; module docstring). ``distinct_layers``: weights of their own for the first N layers only,
    repeated through the rest (``random_model``; the row's ``distinct_layers``).

    On ``cuda`` (the bench): the ``triton`` backend and CUDA-graph replay. ``device="cpu"`` with
    a CPU ``ops`` backend runs eager steps: the command path and the arithmetic (timings then
    mean nothing), for tests; no peer there."""
    cfg = preset_config(preset, layers)
    full_layers = preset_config(preset).num_hidden_layers
    cuda = device == "cuda"
    distinct_layers = check_distinct_layers(distinct_layers, cfg)
    if cuda:
        from gptoss_fp8.bench.prefill import check_fits
        from gptoss_fp8.model.graph import DecodeGraphs
        from gptoss_fp8.model.triton_ops import TritonOps

        check_fits(cfg, f"{preset} with {cfg.num_hidden_layers} layers", distinct_layers=distinct_layers)
        ops = ops or TritonOps(config=kernel_config)
    t0 = time.perf_counter()
    model = random_model(cfg, device, seed, distinct_layers=distinct_layers)
    what = f"{torch.cuda.get_device_name()}" if cuda else "cpu"
    echo(f"# {preset}{distinct_text(distinct_layers)}: {cfg.num_hidden_layers} of {full_layers} layers, "
         f"random FP8 weights on {what} in "
         f"{time.perf_counter() - t0:.1f} s; KV cache random bf16 (no prefill), CUDA-graph replay: {cuda}")
    graphs = DecodeGraphs(model, ops) if cuda else None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = []
    for context in contexts:
        for batch in batches:
            max_len = context + 1  # the step writes row ``context`` (lengths reset before each step)
            need = cache_bytes(cfg, batch, max_len)
            base = {"model": preset, "layers": cfg.num_hidden_layers, "full_layers": full_layers, "batch": batch,
                    "context": context, "cache_bytes": need, "distinct_layers": distinct_layers}
            if cuda:
                free, _ = torch.cuda.mem_get_info()
                if need + HEADROOM > free:
                    row = {**base, "skipped": f"the cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                                              f"beside the weights"}
                    rows.append(row)
                    echo(format_row(row))
                    continue
            cache = synthetic_cache(model, batch, context, max_len, seed)
            tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device)
            reset = lambda c=cache: set_context(c, context)  # noqa: E731
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                times = _time_steps(lambda c=cache, t=tokens: graphs.step(c, t), reset, runs, warmup, cuda)
                peak = torch.cuda.max_memory_allocated()
            else:
                times = _time_steps(lambda c=cache, t=tokens: model.decode(c, t, ops), reset, runs, warmup, cuda)
                peak = None
            step_s = statistics.median(times)
            row = {**base, **row_figures(cfg, batch, context, step_s), "runs_s": times, "peak_mem_bytes": peak,
                   **_breakdown(model, cache, tokens, ops, reset, cfg.num_local_experts, cuda)}
            rows.append(row)
            echo(format_row(row))
            del cache, reset, tokens  # ``reset`` holds the cache too: free it before the next case's check
            if cuda:
                graphs = DecodeGraphs(model, ops)  # drop the case's graph and its pool
                torch.cuda.empty_cache()
    if peer and cuda:
        model = ops = graphs = None  # free our weights and graph pools before the peer builds its own
        gc.collect()
        torch.cuda.empty_cache()
        _add_peer(rows, preset, layers, batches, contexts, peer_steps, seed, echo, peer_modes)
    return rows


def _add_peer(rows: list[dict], preset: str, layers: int | None, batches: list[int], contexts: list[int],
              steps: int, seed: int, echo, modes: tuple[str, ...] | None = None) -> None:
    """transformers' bf16 decode step on the same cases (bench/decode_peer.py) in each peer mode
    (``modes``; None: all of ``decode_peer.PEER_MODES``), beside ours: per row ``peer_modes`` (each
    mode's figures, ``speedup`` ours against it, or ``failed``) and the fastest mode that ran as
    ``peer_mode``, ``peer_ms_per_step``, ``speedup_vs_peer``, ...; ``peer_failed`` when none ran."""
    if preset != "20b":
        why = "does not fit one GPU in bf16 (no peer)" if preset == "120b" else "the peer runs for 20b only"
        echo(f"# transformers peer not run: {preset} {why}")
        return
    from gptoss_fp8.bench import decode_peer, prefill_peer

    why = prefill_peer.transformers_available()
    if why is not None:
        echo(f"# transformers peer not run: {why}")
        return
    modes = tuple(modes or decode_peer.PEER_MODES)
    res = decode_peer.bench_decode_peer(preset, batches, contexts, layers=layers, steps=steps, seed=seed, echo=echo,
                                        modes=modes)
    for r in rows:
        got = res.get((r["batch"], r["context"])) or {}
        r["peer_modes"] = {}
        for mode in modes:
            m = dict(got.get(mode) or {"failed": "not measured"})
            if not m.get("failed"):
                m["tok_s_per_user"] = 1e3 / m["ms_per_step"]
                if r.get("ms_per_step"):
                    m["speedup"] = m["ms_per_step"] / r["ms_per_step"]  # same layers on both sides
            r["peer_modes"][mode] = m
        ran = {mode: m for mode, m in r["peer_modes"].items() if not m.get("failed")}
        if not ran:
            r["peer_failed"] = "; ".join(f"{mode}: {m['failed']}" for mode, m in r["peer_modes"].items())
        else:
            mode = min(ran, key=lambda k: ran[k]["ms_per_step"])  # the peer at its best: the faster mode
            best = ran[mode]
            r["peer_mode"] = mode
            r["peer_ms_per_step"] = best["ms_per_step"]
            r["peer_tok_s_per_user"] = best["tok_s_per_user"]
            r["peer_attn_implementation"] = best["attn_implementation"]
            r["peer_runs_s"] = best["runs_s"]
            if "speedup" in best:
                r["speedup_vs_peer"] = best["speedup"]
        echo(format_peer(r))


def format_peer(r: dict) -> str:
    head = f"{r['model']} L{r['layers']} b={r['batch']} ctx={r['context']}: transformers bf16 "
    parts = []
    for mode, m in r.get("peer_modes", {}).items():
        if m.get("failed"):
            parts.append(f"{mode} failed ({m['failed']})")
            continue
        how = f"{m['attn_implementation']}, {m.get('cache', '?')}" + (", CUDA graph" if m.get("cuda_graph") else "")
        if m.get("compile_s") is not None:
            how += f"; compile {m['compile_s']:.0f} s"
        parts.append(f"{mode} {m['ms_per_step']:.3f} ms/step ({how})")
    line = head + " | ".join(parts)
    if r.get("peer_failed"):
        return line if parts else head + f"failed ({r['peer_failed']})"
    if r.get("speedup_vs_peer") is not None:
        line += (f"; vs ours {r['ms_per_step']:.3f} ms/step: x{r['speedup_vs_peer']:.1f} against the faster mode "
                 f"that ran ({r['peer_mode']}, {r['peer_tok_s_per_user']:.1f} tok/s/user)")
    else:
        line += f" (ours skipped: {r.get('skipped')})"
    return line

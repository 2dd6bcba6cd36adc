"""The peer for ``gptoss-fp8 bench decode``: transformers' bf16 GptOss decoding, measured per step.

Measured, per (batch B, context) case: Hugging Face transformers' ``GptOssForCausalLM`` in bf16 at a
synthetic preset's real shapes (random weights built on the GPU, resident; ``prefill_peer.
build_peer``), one decode step of B sequences = ``model(input_ids=next [B, 1], past_key_values=
cache, use_cache=True)`` (logits [B, 1, V] out), as transformers' own ``generate`` loop calls it
for gpt-oss's default cache: eager, no CUDA graph, no torch.compile of the model (generate compiles
the forward only for a static cache). Each step is timed with ``time.perf_counter`` between two
``torch.cuda.synchronize()`` calls (host launch time included, as a user sees it), after
``warmup`` untimed steps; the figure is the median over ``steps`` steps. New token ids are random,
one per sequence per step, drawn on the device before the first step.

The KV cache is the peer's own, filled by its own prefill (untimed): random prompts of
``context`` tokens with ``use_cache=True, logits_to_keep=1`` return ``past_key_values``, the cache
transformers picks itself for gpt-oss (5.x: a ``DynamicCache`` built from the config, full layers
growing by ``torch.cat``, sliding layers keeping the last ``sliding_window - 1`` tokens). The
prompts go through in chunks of ``prefill_chunk`` tokens (transformers' chunked prefill, what
``generate(prefill_chunk_size=...)`` does; eager attention's T x T scores would not fit at 32768
otherwise). Only ``prefill_tokens`` tokens of whole sequences (at least one sequence; None: all B)
are prefilled per case; the batch's other sequences get copies of their K / V rows (real copies:
every step reads B sequences' bytes), and every sequence decodes its own random tokens, so the
queries, the attention outputs and the routing still differ per sequence. The step's work does not
depend on the cached values (what our bench's random synthetic cache relies on as well); this
keeps the prefill of a case to one or two prompts instead of up to 128 (a full 20b sweep would
prefill ~340 prompts otherwise: minutes of untimed work).

The cache grows by one token per step, as in generation: the warmup steps read ``context`` to
``context + warmup - 1`` cached tokens, the timed steps up to ``context + warmup + steps - 1``
(our bench resets its cache to ``context`` before every step). 25 tokens against 8192 are 0.3% of
the KV bytes, and the KV bytes are a part of the step: negligible.

Attention (``attn_implementation``, prefill and steps; recorded in each result): ``eager`` by
default (transformers' ``eager_attention_forward``: K / V repeated to every query head, bf16
matmuls, sinks concatenated before the softmax; what ``attn_implementation="eager"`` gives), or
``flex_attention`` (torch.compile'd FlexAttention, sinks folded in through the LSE, a BlockMask
built every step; the prefill peer's choice). Measured on an H200 (20b, 2026-12-01, a flex prefill
of whole prompts, 5 + 10 steps): eager 42.9 ms/step at batch 1 / 8192 tokens (115 ms at 32, 50.7
ms at 1 / 32768, 373 ms at 32 / 32768); flex_attention 99.1 ms/step at batch 1 / 8192, and it
compiles (prefill and decode shapes; torch.compile's caches are reset before the first step, so the
second recompiles with a dynamic KV length) for minutes per case: its batch-32 case did not end
within a 10-minute run; and after this module's chunked prefill its decode step raised an
InductorError compiling FlexAttention (H200, torch 2.11, transformers 5.17, tests/test_decode_peer.py,
fourteenth session). So eager is the peer; ``compiles_in_timed_steps`` counts graphs compiled
while timing (0 unless a flex warmup was too short).

A case whose cache cannot fit beside the weights (an estimate from the shapes, before any
prefill) or that runs out of memory, or fails inside transformers, becomes ``{"failed": one line}``;
memory is freed between cases. transformers is NOT a dependency: it is imported only inside
functions here (``prefill_peer.transformers_available`` says why it cannot be used).
"""

from __future__ import annotations

import statistics
import time

import torch

from gptoss_fp8.bench.prefill_peer import _free, _one_line, _sync, start_peer
from gptoss_fp8.config import GptOssConfig

DECODE_ATTN = "eager"
ATTN_CHOICES = ("eager", "flex_attention")
# Distinct prompt tokens prefilled per case (whole sequences, at least one): the batch's other
# sequences repeat them (module docstring). Also the tokens of one group of sequences prefilled together.
PREFILL_TOKENS = 16384
PREFILL_CHUNK = 1024  # tokens per prefill forward, as generate(prefill_chunk_size=1024) feeds them
HEADROOM = 2 << 30  # bytes kept free beside the estimated cache: activations, logits, allocator slack


def peer_cache_bytes(cfg: GptOssConfig, batch: int, tokens: int, attn_implementation: str = DECODE_ATTN) -> int:
    """Bytes the peer's cache of ``batch`` sequences holding ``tokens`` tokens takes at its largest
    (full layers ``tokens`` rows, sliding ones ``sliding_window``, bf16 K and V), plus what one decode
    step allocates beside it: the full layer's grown copy (``torch.cat``) and, with ``eager``
    attention, K and V repeated to every query head."""
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = [min(tokens, cfg.sliding_window) if t == "sliding_attention" and cfg.sliding_window > 0 else tokens
            for t in cfg.layer_types]
    cache = batch * sum(rows) * per_token
    step = batch * max(rows) * per_token
    if attn_implementation == "eager":
        step += batch * max(rows) * per_token * (cfg.num_attention_heads // cfg.num_key_value_heads)
    return cache + step


def _set_attn(model, attn_implementation: str) -> None:
    if model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)


@torch.no_grad()
def peer_prefill_cache(model, ids: torch.Tensor, chunk: int = PREFILL_CHUNK, seqs_per_group: int | None = None):
    """ids int [D, T] -> (the peer's cache holding the D sequences, logits [D, V] of their last
    positions). Groups of ``seqs_per_group`` sequences (default all), each group's prompts fed in
    token chunks of ``chunk`` through its cache (transformers' chunked prefill, as ``generate`` runs
    it with ``prefill_chunk_size``); the groups' caches concatenated along the batch, layer by layer
    (each group's tensors freed as they are merged). The model's current attention implementation."""
    groups, last = [], []
    g = seqs_per_group or ids.shape[0]
    for s in range(0, ids.shape[0], g):
        cache = None
        for t in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[s:s + g, t:t + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        groups.append(cache)
        last.append(out.logits[:, -1])
        del out
    cache = groups[0]
    for i, layer in enumerate(cache.layers):
        parts = [c.layers[i] for c in groups]
        if len(parts) > 1:
            layer.keys = torch.cat([p.keys for p in parts])
            layer.values = torch.cat([p.values for p in parts])
            for p in parts[1:]:
                p.keys = p.values = None
        assert layer.keys.shape[0] == ids.shape[0], (i, tuple(layer.keys.shape))
    return cache, torch.cat(last)


@torch.no_grad()
def tile_cache(cache, batch: int) -> None:
    """Grow a cache of D sequences to ``batch`` (sequence b holds sequence b % D's keys and values),
    copied (real rows, read by every step as distinct sequences' would be)."""
    for layer in cache.layers:
        d = layer.keys.shape[0]
        if d == batch:
            continue
        reps, rest = divmod(batch, d)
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, torch.cat([t] * reps + ([t[:rest]] if rest else [])))


@torch.no_grad()
def peer_decode_step(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step: tokens int [B, 1] (one new token per sequence, at the cache's length) ->
    logits [B, V]; the cache grows by one token (in place)."""
    out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
    assert out.past_key_values is cache
    return out.logits[:, -1]


def _graphs_compiled() -> int:
    """torch.compile's count of graphs compiled so far in this process (0 where unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def _case(model, cfg: GptOssConfig, batch: int, context: int, steps: int, warmup: int, gen: torch.Generator,
          dev: torch.device, attn_implementation: str, prefill_tokens: int | None, prefill_chunk: int) -> dict:
    """One case; raises on failure (the caller records it)."""
    cuda = dev.type == "cuda"
    per_group = max(1, (prefill_tokens or PREFILL_TOKENS) // context)
    distinct = batch if prefill_tokens is None else min(batch, per_group)
    ids = torch.randint(0, cfg.vocab_size, (distinct, context), generator=gen, device=dev)
    nxt = torch.randint(0, cfg.vocab_size, (warmup + steps, batch, 1), generator=gen, device=dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t0 = time.perf_counter()
    cache, _ = peer_prefill_cache(model, ids, prefill_chunk, per_group)
    del ids
    tile_cache(cache, batch)
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    if attn_implementation == "flex_attention":
        torch.compiler.reset()  # compile the decode shapes afresh (not as a recompile of the prefill's)
    for i in range(warmup):
        peer_decode_step(model, cache, nxt[i])
    compiled0 = _graphs_compiled()
    times = []
    for i in range(warmup, warmup + steps):
        _sync(dev)
        t0 = time.perf_counter()
        peer_decode_step(model, cache, nxt[i])
        _sync(dev)
        times.append(time.perf_counter() - t0)
    held = cache.get_seq_length()
    assert held == context + warmup + steps, (held, context, warmup, steps)
    assert all(layer.keys.shape[0] == batch for layer in cache.layers)
    return {
        "ms_per_step": statistics.median(times) * 1e3,
        "runs_s": times,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "attn_implementation": attn_implementation,
        "distinct_sequences": distinct,
        "prefill_s": prefill_s,
        "cache_tokens_end": held,
        "compiles_in_timed_steps": _graphs_compiled() - compiled0,
    }


def bench_decode_peer(preset: str, batches: list[int], contexts: list[int], layers: int | None = None,
                      steps: int = 20, warmup: int = 5, seed: int = 0, echo=print, device: str = "cuda",
                      attn_implementation: str = DECODE_ATTN, prefill_tokens: int | None = PREFILL_TOKENS,
                      prefill_chunk: int = PREFILL_CHUNK) -> dict[tuple[int, int], dict]:
    """The peer's decode step per case: ``{(batch, context): {"ms_per_step", "runs_s", "peak_mem_bytes",
    "attn_implementation", ...}}`` or ``{(batch, context): {"failed": one line}}``.

    The model is built once per call; each case prefills its own cache (module docstring), then
    times ``steps`` steps after ``warmup``. Never raises for the peer's sake (transformers missing,
    no GPU, weights or a cache that do not fit, a failure inside transformers: a ``failed`` line
    per case); only a bad preset / layers value raises GptOssFp8Error."""
    from gptoss_fp8.config import preset_config

    cfg = preset_config(preset, layers)
    full_layers = preset_config(preset).num_hidden_layers
    cases = [(b, c) for c in contexts for b in batches]
    dev = torch.device(device)
    if attn_implementation not in ATTN_CHOICES:
        raise ValueError(f"attn_implementation {attn_implementation!r}: choose from {', '.join(ATTN_CHOICES)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps {steps} must be >= 1 and warmup {warmup} >= 0")

    def fail_all(reason: str) -> dict[tuple[int, int], dict]:
        echo(f"# transformers decode peer: {reason}")
        return {k: {"failed": reason} for k in cases}

    t0 = time.perf_counter()
    model, reason = start_peer(preset, cfg, dev, seed, attn_implementation)
    if reason:
        return fail_all(reason)
    import transformers

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    distinct = "every sequence" if prefill_tokens is None else f"up to {prefill_tokens} tokens of whole sequences"
    echo(f"# transformers {transformers.__version__} GptOssForCausalLM bf16 decode ({attn_implementation} attention, "
         f"{model.config._experts_implementation} experts, DynamicCache, eager loop, no CUDA graph): {preset}, "
         f"{cfg.num_hidden_layers} of {full_layers} layers built on {where} in {time.perf_counter() - t0:.1f} s; "
         f"its own prefill (untimed, {distinct} per case, repeated over the batch), then {warmup} + {steps} steps "
         f"per case, the cache growing by one token a step")
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    out: dict[tuple[int, int], dict] = {}
    for batch, context in cases:
        r = None
        if dev.type == "cuda":
            need = peer_cache_bytes(cfg, batch, context + warmup + steps, attn_implementation)
            free, _ = torch.cuda.mem_get_info(dev)
            if need + HEADROOM > free:
                r = {"failed": f"out of memory (estimated: the cache needs {need / 2**30:.1f} GiB, "
                               f"{free / 2**30:.1f} GiB free beside the weights; not run)"}
        if r is None:
            try:
                r = _case(model, cfg, batch, context, steps, warmup, gen, dev, attn_implementation, prefill_tokens,
                          prefill_chunk)
            except torch.cuda.OutOfMemoryError:
                r = {"failed": "out of memory"}
            except Exception as e:  # noqa: BLE001 - third-party code at its limits: record it, keep benchmarking
                r = {"failed": _one_line(e)}
        _free(dev)  # outside the except blocks: the case's cache (and a traceback's frames) are gone
        out[(batch, context)] = r
        echo(format_case(preset, batch, context, cfg.num_hidden_layers, full_layers, r))
    del model
    _free(dev)
    return out


def format_case(preset: str, batch: int, context: int, layers: int, full_layers: int, r: dict) -> str:
    head = f"transformers {preset} L{layers}/{full_layers} b={batch} ctx={context}: "
    if r.get("failed"):
        return head + f"failed ({r['failed']})"
    line = (head + f"{r['ms_per_step']:.3f} ms/step ({r['attn_implementation']}), {1e3 / r['ms_per_step']:.1f} tok/s/user; "
            f"prefill {r['prefill_s']:.1f} s (untimed, {r['distinct_sequences']} distinct)")
    if r["peak_mem_bytes"] is not None:
        line += f"; peak mem {r['peak_mem_bytes'] / 2**30:.1f} GiB"
    if r.get("compiles_in_timed_steps"):
        line += f"; {r['compiles_in_timed_steps']} graphs compiled while timing (raise the warmup)"
    return line

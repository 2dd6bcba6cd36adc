"""The peer for ``gptoss-fp8 bench decode``: transformers' bf16 GptOss decoding, measured per step.

Measured, per (batch B, context) case and per peer mode: Hugging Face transformers'
``GptOssForCausalLM`` in bf16 at a synthetic preset's real shapes (random weights built on the
GPU, resident; ``prefill_peer.build_peer``), one decode step of B sequences (one new token each, logits
[B, 1, V] out). Each step is timed with ``time.perf_counter`` between two ``torch.cuda.synchronize()``
calls (host work included, as a user sees it), after untimed warm-up steps; the figure is the median
over ``steps`` steps. New token ids are random, one per sequence per step, drawn on the device
before the first step. Two modes (``PEER_MODES``), each with its own prefill of the case:

* ``eager``: ``model(input_ids=next [B, 1], past_key_values=cache, use_cache=True)`` as transformers'
  own ``generate`` loop calls it for gpt-oss's default cache (a ``DynamicCache``): eager, no CUDA
  graph, no torch.compile (generate compiles the forward only for a static cache).
* ``compiled``: the peer at its best. A ``StaticCache`` sized to ``context + warm-up + steps +
  STATIC_MARGIN`` (transformers builds it from the config: ``StaticLayer`` for the full layers,
  ``StaticSlidingWindowLayer`` for the sliding ones, a window of ``sliding_window`` rows that rolls
  by one row per decode step once full); the step's inputs built eagerly outside the forward as
  generate builds them for a compilable cache (position ids, the 4D masks per layer type from
  ``create_masks_for_generate``); ``model.__call__`` compiled by torch.compile (inductor,
  ``fullgraph=True``, default mode), caches reset before each case so that every case compiles its
  own static shapes. The sliding layers count their tokens in a Python int (``cumulative_length_int``,
  which picks their branch and grows every step): left alone, dynamo specialises the first graph on
  it and recompiles at the next step with it as a SymInt input (what generate's default
  ``CompileConfig(dynamic=None)`` does), so the compile marks it dynamic from the start
  (``SLIDING_LENGTH_SOURCES``): one graph. With that int an input of the graph (seen on CPU),
  generate's ``mode="reduce-overhead"`` would record a new CUDA graph per distinct value, i.e. per
  step (torch 2.13's CUDA-graph trees key their recordings by the graph's int inputs,
  ``cudagraphify_impl``; read, not measured; transformers issue 44609 reports the recompiles), so on
  a GPU one compiled step is instead captured as a CUDA graph by hand and replayed, its inputs (token
  ids, position ids, masks) copied into the graph's static buffers first. The captured step reads
  every length it needs from the device (the full layers' ``cumulative_length`` tensor; a full
  window always takes the same roll branch: the capture refuses a window not yet full), so only the
  sliding layers' host int is kept by this module: the capture ran its host code once (undone), each
  replay adds one. ``compile_s`` (untimed, reported) is the warm-up: ``max(warmup, COMPILE_WARMUP)``
  real steps through the compiled forward (the first compiles) and the capture; ``graphs_compiled``
  counts dynamo's graphs (1 expected). The step includes building its inputs as generate does
  (eager Python and small kernels, ~0.5 ms of host time on a slow CPU); ``inputs_ms`` records that
  part alone. On CPU (tests) the compiled forward runs every step, no graph.

The KV cache is the peer's own, filled by its own prefill (untimed): random prompts of
``context`` tokens with ``use_cache=True, logits_to_keep=1``, in chunks of ``prefill_chunk``
tokens (transformers' chunked prefill, what ``generate(prefill_chunk_size=...)`` does; eager
attention's T x T scores would not fit at 32768 otherwise), into the cache transformers picks for
gpt-oss (eager mode; 5.x: a ``DynamicCache`` built from the config, full layers growing by
``torch.cat``, sliding layers keeping the last ``sliding_window - 1`` tokens) or into the
``StaticCache`` (compiled mode; its own update code, full windows rolled). Only ``prefill_tokens``
tokens of whole sequences (at least one sequence; None: all B) are prefilled per case; the batch's
other sequences get copies of their K / V rows (real copies: every step reads B sequences' bytes),
and every sequence decodes its own random tokens, so the queries, the attention outputs and the
routing still differ per sequence. The step's work does not depend on the cached values (what our
bench's random synthetic cache relies on as well); this keeps the prefill of a case to one or two
prompts instead of up to 128 (a full 20b sweep would prefill ~340 prompts otherwise: minutes of
untimed work).

The cache grows by one token per step, as in generation: the warmup steps read ``context`` to
``context + warmup - 1`` cached tokens, the timed steps up to ``context + warmup + steps - 1``
(our bench resets its cache to ``context`` before every step). 25 tokens against 8192 are 0.3% of
the KV bytes, and the KV bytes are a part of the step: negligible. (The static cache's full layers
attend over all their rows, masked: ``STATIC_MARGIN`` + the steps not yet taken, as negligible.)

Attention (``attn_implementation``, prefill and steps, both modes; recorded in each result):
``eager`` by default (transformers' ``eager_attention_forward``: K / V repeated to every query
head, bf16 matmuls, sinks concatenated before the softmax; what ``attn_implementation="eager"``
gives; gpt-oss has no ``sdpa``), or ``flex_attention`` (torch.compile'd FlexAttention, sinks folded
in through the LSE, a BlockMask built every step; the prefill peer's choice; its BlockMasks are not
tensors, so the compiled mode cannot capture them and fails on a GPU). Experts: the model's
``grouped_mm`` in both modes (``generate`` switches to ``batched_mm`` for its decode loop on a GPU,
which gathers the top-k experts' weights per token; not measured here). Measured on an H200 (20b,
2026-12-01, a flex prefill of whole prompts, 5 + 10 steps, eager mode): eager 42.9 ms/step at batch
1 / 8192 tokens (115 ms at 32, 50.7 ms at 1 / 32768, 373 ms at 32 / 32768); flex_attention 99.1
ms/step at batch 1 / 8192, and it compiles (prefill and decode shapes; torch.compile's caches are
reset before the first step, so the second recompiles with a dynamic KV length) for minutes per
case: its batch-32 case did not end within a 10-minute run; and after this module's chunked
prefill its decode step raised an InductorError compiling FlexAttention (H200, torch 2.11,
transformers 5.17, tests/test_decode_peer.py, fourteenth session). So eager is the peer;
``compiles_in_timed_steps`` counts graphs compiled while timing (0 unless a warmup was too short).

A case whose cache cannot fit beside the weights (an estimate from the shapes, before any
prefill) or that runs out of memory, or fails inside transformers or torch.compile, becomes
``{"failed": one line}`` for that mode (the other mode's figure stands); memory is freed between
cases and modes. transformers is NOT a dependency: it is imported only inside functions here
(``prefill_peer.transformers_available`` says why it cannot be used).
"""

from __future__ import annotations

import statistics
import time

import torch

from gptoss_fp8.bench.prefill_peer import _free, _one_line, _sync, start_peer
from gptoss_fp8.config import GptOssConfig

DECODE_ATTN = "eager"
ATTN_CHOICES = ("eager", "flex_attention")
PEER_MODES = ("eager", "compiled")
# Distinct prompt tokens prefilled per case (whole sequences, at least one): the batch's other
# sequences repeat them (module docstring). Also the tokens of one group of sequences prefilled together.
PREFILL_TOKENS = 16384
PREFILL_CHUNK = 1024  # tokens per prefill forward, as generate(prefill_chunk_size=1024) feeds them
HEADROOM = 2 << 30  # bytes kept free beside the estimated cache: activations, logits, allocator slack
STATIC_MARGIN = 8  # spare rows of the static cache past the last step's
# Steps through the compiled forward before the capture: the compile, then runs of the compiled code
# (Triton's first-launch autotuning and loading done before the capture).
COMPILE_WARMUP = 3
# The static sliding layers' host token counts, which change every step: marked dynamic for the
# compile (torch.compiler.config.dynamic_sources, a regex on dynamo's source names) so that dynamo
# compiles the forward once with them as SymInts, not once specialised and again on the next step.
SLIDING_LENGTH_SOURCES = r".*\.cumulative_length_int$"


def peer_cache_bytes(cfg: GptOssConfig, batch: int, tokens: int, attn_implementation: str = DECODE_ATTN,
                     static: bool = False) -> int:
    """Bytes the peer's cache of ``batch`` sequences holding ``tokens`` tokens takes at its largest
    (full layers ``tokens`` rows, sliding ones ``sliding_window``, bf16 K and V), plus what one decode
    step allocates beside it: the full layer's grown copy (``torch.cat``; not for a ``static`` cache,
    whose ``tokens`` is then its length) and, with ``eager`` attention, K and V repeated to every
    query head."""
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = [min(tokens, cfg.sliding_window) if t == "sliding_attention" and cfg.sliding_window > 0 else tokens
            for t in cfg.layer_types]
    cache = batch * sum(rows) * per_token
    step = 0 if static else batch * max(rows) * per_token
    if attn_implementation == "eager":
        step += batch * max(rows) * per_token * (cfg.num_attention_heads // cfg.num_key_value_heads)
    return cache + step


def _set_attn(model, attn_implementation: str) -> None:
    if model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)


def _set_kv(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A cache layer's K / V replaced (the batch grown); a static layer also gets its batch size and
    the static addresses its own allocation marks (what torch.compile and CUDA graphs rely on)."""
    layer.keys, layer.values = keys, values
    if layer.is_compileable:
        layer.batch_size = keys.shape[0]
        torch._dynamo.mark_static_address(keys)
        torch._dynamo.mark_static_address(values)


def peer_static_cache(model, max_len: int):
    """transformers' ``StaticCache`` for the model's config holding up to ``max_len`` tokens per
    sequence (its layers allocate on their first update, at that update's batch)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


@torch.no_grad()
def peer_prefill_cache(model, ids: torch.Tensor, chunk: int = PREFILL_CHUNK, seqs_per_group: int | None = None,
                       max_len: int | None = None):
    """ids int [D, T] -> (the peer's cache holding the D sequences, logits [D, V] of their last
    positions). Groups of ``seqs_per_group`` sequences (default all), each group's prompts fed in
    token chunks of ``chunk`` through its cache (transformers' chunked prefill, as ``generate`` runs
    it with ``prefill_chunk_size``); the groups' caches concatenated along the batch, layer by layer
    (each group's tensors freed as they are merged). The cache: the one the model builds itself
    (a ``DynamicCache``), or with ``max_len`` a ``StaticCache`` of that length per group. The
    model's current attention implementation."""
    groups, last = [], []
    g = seqs_per_group or ids.shape[0]
    for s in range(0, ids.shape[0], g):
        cache = None if max_len is None else peer_static_cache(model, max_len)
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
            _set_kv(layer, torch.cat([p.keys for p in parts]), torch.cat([p.values for p in parts]))
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
        grown = [torch.cat([t] * reps + ([t[:rest]] if rest else [])) for t in (layer.keys, layer.values)]
        _set_kv(layer, *grown)


@torch.no_grad()
def peer_decode_step(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step: tokens int [B, 1] (one new token per sequence, at the cache's length) ->
    logits [B, V]; the cache grows by one token (in place)."""
    out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
    assert out.past_key_values is cache
    return out.logits[:, -1]


def _step_inputs(model, cache, batch: int, device: torch.device):
    """What ``generate`` gives the forward of one decode step on a compilable cache, built eagerly:
    (the cache's length, position ids int [B, 1] at it, the 4D masks per layer type from
    ``create_masks_for_generate`` and the 2D all-ones attention mask generate keeps)."""
    from transformers.masking_utils import create_masks_for_generate

    seen = int(cache.get_seq_length())
    pos = torch.full((batch, 1), seen, dtype=torch.long, device=device)
    masks = create_masks_for_generate(
        config=model.config, inputs_embeds=torch.empty((batch, 1, 0), dtype=model.dtype, device=device),
        attention_mask=torch.ones((batch, seen + 1), dtype=torch.long, device=device), past_key_values=cache,
        position_ids=pos)
    return seen, pos, masks


@torch.no_grad()
def peer_static_step(model, cache, tokens: torch.Tensor, forward=None) -> torch.Tensor:
    """One decode step on a ``StaticCache`` as generate runs it there: tokens int [B, 1] -> logits
    [B, V]; position ids and masks built outside the forward (``_step_inputs``), then ``forward``
    (default the model; the compiled mode's torch.compile'd ``model.__call__``). The cache grows by
    one token (in place)."""
    _, pos, masks = _step_inputs(model, cache, tokens.shape[0], tokens.device)
    out = (forward or model)(input_ids=tokens, past_key_values=cache, position_ids=pos, attention_mask=masks,
                             use_cache=True)
    return out.logits[:, -1]


def _host_lengths(cache) -> list[int]:
    """The static sliding layers' host token counts (``cumulative_length_int``), in layer order."""
    return [layer.cumulative_length_int for layer in cache.layers if hasattr(layer, "cumulative_length_int")]


def _set_host_lengths(cache, lengths: list[int]) -> None:
    layers = [layer for layer in cache.layers if hasattr(layer, "cumulative_length_int")]
    assert len(layers) == len(lengths), (len(layers), len(lengths))
    for layer, n in zip(layers, lengths, strict=True):
        layer.cumulative_length_int = n


def _device_lengths(cache) -> list[int]:
    """The static full layers' token counts (device tensors; reads them: a synchronisation)."""
    return [int(layer.cumulative_length) for layer in cache.layers if not hasattr(layer, "cumulative_length_int")]


class CompiledDecode:
    """The compiled mode's decode step on one ``StaticCache`` (module docstring):
    ``step(tokens int [B, 1]) -> logits [B, V]``, the cache growing by one token.

    Built by running ``warm_tokens`` (int [W, B, 1]) as W real decode steps through
    ``torch.compile(model.__call__, fullgraph=True)`` (they compile it; on a side stream on CUDA),
    then with ``cuda_graph`` capturing one step as a CUDA graph, which every call replays; without,
    every call runs the compiled forward. The returned logits are the graph's output buffer,
    overwritten by the next replay: clone to keep."""

    def __init__(self, model, cache, warm_tokens: torch.Tensor, cuda_graph: bool):
        self.model, self.cache, self.graph = model, cache, None
        self.forward = torch.compile(model.__call__, fullgraph=True)
        self.room = max(layer.max_cache_len for layer in cache.layers)
        dev = warm_tokens.device
        if not cuda_graph:
            self._warm_up(warm_tokens)
            return
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # torch's recipe: warm-up runs on a side stream before capture
            self._warm_up(warm_tokens)
        torch.cuda.current_stream(dev).wait_stream(side)
        self._capture(warm_tokens[-1])

    def _warm_up(self, warm_tokens: torch.Tensor) -> None:
        with torch.compiler.config.patch(dynamic_sources=SLIDING_LENGTH_SOURCES):
            for t in warm_tokens:
                peer_static_step(self.model, self.cache, t, self.forward)

    @torch.no_grad()
    def _capture(self, tokens: torch.Tensor) -> None:
        cache = self.cache
        host = _host_lengths(cache)
        windows = [layer.max_cache_len for layer in cache.layers if hasattr(layer, "cumulative_length_int")]
        if any(n < w for n, w in zip(host, windows, strict=True)):
            raise ValueError(f"the compiled peer's CUDA graph needs full sliding windows ({windows} rows), the cache "
                             f"holds {host} tokens: the captured step would keep the not-full branch")
        self.ids = tokens.clone()
        _, self.pos, self.masks = _step_inputs(self.model, cache, tokens.shape[0], tokens.device)
        if not all(isinstance(m, torch.Tensor) for m in self.masks.values()):
            kinds = {k: type(m).__name__ for k, m in self.masks.items()}
            raise ValueError(f"the compiled peer's CUDA graph needs tensor masks (eager attention), got {kinds}")
        held, compiled = _device_lengths(cache), _graphs_compiled()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = self.forward(input_ids=self.ids, past_key_values=cache, position_ids=self.pos,
                               attention_mask=self.masks, use_cache=True)
        self.logits = out.logits[:, -1]
        # The capture ran one step's host code (the sliding layers' int += 1) and none of its kernels.
        assert _graphs_compiled() == compiled, "torch.compile recompiled during the capture (a guard failed)"
        assert _host_lengths(cache) == [n + 1 for n in host], (host, _host_lengths(cache))
        assert _device_lengths(cache) == held, (held, _device_lengths(cache))
        _set_host_lengths(cache, host)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return peer_static_step(self.model, self.cache, tokens, self.forward)
        seen, pos, masks = _step_inputs(self.model, self.cache, tokens.shape[0], tokens.device)
        if seen >= self.room:
            raise ValueError(f"the static cache's {self.room} rows are full")
        self.ids.copy_(tokens)
        self.pos.copy_(pos)
        for k, m in masks.items():
            self.masks[k].copy_(m)
        self.graph.replay()
        _set_host_lengths(self.cache, [n + 1 for n in _host_lengths(self.cache)])
        return self.logits


def _graphs_compiled() -> int:
    """torch.compile's count of graphs compiled so far in this process (0 where unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def _seconds(fn, dev: torch.device) -> float:
    """Wall seconds of one ``fn()`` between two device synchronisations."""
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _case(model, cfg: GptOssConfig, batch: int, context: int, steps: int, warmup: int, gen: torch.Generator,
          dev: torch.device, attn_implementation: str, prefill_tokens: int | None, prefill_chunk: int,
          mode: str = "eager") -> dict:
    """One case in one mode; raises on failure (the caller records it)."""
    cuda = dev.type == "cuda"
    compiled = mode == "compiled"
    warm = max(warmup, COMPILE_WARMUP) if compiled else warmup
    max_len = context + warm + steps + STATIC_MARGIN if compiled else None
    per_group = max(1, (prefill_tokens or PREFILL_TOKENS) // context)
    distinct = batch if prefill_tokens is None else min(batch, per_group)
    ids = torch.randint(0, cfg.vocab_size, (distinct, context), generator=gen, device=dev)
    nxt = torch.randint(0, cfg.vocab_size, (warm + steps, batch, 1), generator=gen, device=dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t0 = time.perf_counter()
    cache, _ = peer_prefill_cache(model, ids, prefill_chunk, per_group, max_len)
    del ids
    tile_cache(cache, batch)
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    compile_s = graphs = None
    if compiled:
        torch.compiler.reset()  # this case's static shapes compiled afresh
        graphs0 = _graphs_compiled()
        t0 = time.perf_counter()
        step = CompiledDecode(model, cache, nxt[:warm], cuda_graph=cuda)
        _sync(dev)
        compile_s, graphs = time.perf_counter() - t0, _graphs_compiled() - graphs0
    else:
        if attn_implementation == "flex_attention":
            torch.compiler.reset()  # compile the decode shapes afresh (not as a recompile of the prefill's)
        for i in range(warm):
            peer_decode_step(model, cache, nxt[i])
        step = lambda t: peer_decode_step(model, cache, t)  # noqa: E731
    compiled0 = _graphs_compiled()
    times = [_seconds(lambda i=i: step(nxt[i]), dev) for i in range(warm, warm + steps)]
    inputs_ms = None
    if compiled:  # the part of its step that builds generate's inputs (masks) eagerly, for the record
        inputs_ms = statistics.median(_seconds(lambda: _step_inputs(model, cache, batch, dev), dev) for _ in range(5)) * 1e3
    held = int(cache.get_seq_length())
    assert held == context + warm + steps, (held, context, warm, steps)
    if compiled:  # the graph advanced the full layers' device lengths as the host ints were
        assert _device_lengths(cache) == [held] * len(_device_lengths(cache)), (held, _device_lengths(cache))
    assert all(layer.keys.shape[0] == batch for layer in cache.layers)
    return {
        "mode": mode,
        "ms_per_step": statistics.median(times) * 1e3,
        "runs_s": times,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "attn_implementation": attn_implementation,
        "experts_implementation": model.config._experts_implementation,
        "cache": type(cache).__name__,
        "cache_len": max_len,
        "cuda_graph": compiled and cuda,
        "compile_s": compile_s,
        "graphs_compiled": graphs,
        "inputs_ms": inputs_ms,
        "warmup_steps": warm,
        "distinct_sequences": distinct,
        "prefill_s": prefill_s,
        "cache_tokens_end": held,
        "compiles_in_timed_steps": _graphs_compiled() - compiled0,
    }


def bench_decode_peer(preset: str, batches: list[int], contexts: list[int], layers: int | None = None,
                      steps: int = 20, warmup: int = 5, seed: int = 0, echo=print, device: str = "cuda",
                      attn_implementation: str = DECODE_ATTN, prefill_tokens: int | None = PREFILL_TOKENS,
                      prefill_chunk: int = PREFILL_CHUNK,
                      modes: tuple[str, ...] = PEER_MODES) -> dict[tuple[int, int], dict[str, dict]]:
    """The peer's decode step per case and mode: ``{(batch, context): {mode: {"mode", "ms_per_step",
    "runs_s", "peak_mem_bytes", "attn_implementation", "compile_s", ...}}}``, or ``{mode: {"failed":
    one line}}`` for a mode that did not run.

    The model is built once per call; each case prefills its own cache per mode (module
    docstring), then times ``steps`` steps after ``warmup`` (the compiled mode: at least
    ``COMPILE_WARMUP``). Never raises for the peer's sake (transformers missing, no GPU, weights or
    a cache that do not fit, a failure inside transformers or torch.compile: a ``failed`` line per
    case and mode); only a bad preset / layers / mode value raises."""
    from gptoss_fp8.config import preset_config

    cfg = preset_config(preset, layers)
    full_layers = preset_config(preset).num_hidden_layers
    cases = [(b, c) for c in contexts for b in batches]
    dev = torch.device(device)
    if attn_implementation not in ATTN_CHOICES:
        raise ValueError(f"attn_implementation {attn_implementation!r}: choose from {', '.join(ATTN_CHOICES)}")
    if not modes or any(m not in PEER_MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"modes {modes!r}: choose one or more of {', '.join(PEER_MODES)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps {steps} must be >= 1 and warmup {warmup} >= 0")

    def fail_all(reason: str) -> dict[tuple[int, int], dict[str, dict]]:
        echo(f"# transformers decode peer: {reason}")
        return {k: {m: {"failed": reason} for m in modes} for k in cases}

    t0 = time.perf_counter()
    model, reason = start_peer(preset, cfg, dev, seed, attn_implementation)
    if reason:
        return fail_all(reason)
    import transformers

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    distinct = "every sequence" if prefill_tokens is None else f"up to {prefill_tokens} tokens of whole sequences"
    how = {"eager": "DynamicCache, eager loop, no CUDA graph",
           "compiled": ("StaticCache, torch.compile(fullgraph=True)"
                        + (" + a captured CUDA graph" if dev.type == "cuda" else ", no CUDA graph (CPU)"))}
    echo(f"# transformers {transformers.__version__} GptOssForCausalLM bf16 decode ({attn_implementation} attention, "
         f"{model.config._experts_implementation} experts; modes: "
         + "; ".join(f"{m}: {how[m]}" for m in modes)
         + f"): {preset}, {cfg.num_hidden_layers} of {full_layers} layers built on {where} in "
         f"{time.perf_counter() - t0:.1f} s; its own prefill per case and mode (untimed, {distinct}, repeated over "
         f"the batch), then {warmup} + {steps} steps (compiled: at least {COMPILE_WARMUP} warm-up steps, their "
         f"compile reported apart), the cache growing by one token a step")
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for batch, context in cases:
        out[(batch, context)] = {}
        for mode in modes:
            r = None
            if dev.type == "cuda":
                static = mode == "compiled"
                tokens = context + max(warmup, COMPILE_WARMUP if static else 0) + steps + (STATIC_MARGIN if static else 0)
                need = peer_cache_bytes(cfg, batch, tokens, attn_implementation, static)
                free, _ = torch.cuda.mem_get_info(dev)
                if need + HEADROOM > free:
                    r = {"failed": f"out of memory (estimated: the cache needs {need / 2**30:.1f} GiB, "
                                   f"{free / 2**30:.1f} GiB free beside the weights; not run)"}
            if r is None:
                try:
                    r = _case(model, cfg, batch, context, steps, warmup, gen, dev, attn_implementation, prefill_tokens,
                              prefill_chunk, mode)
                except torch.cuda.OutOfMemoryError:
                    r = {"failed": "out of memory"}
                except Exception as e:  # noqa: BLE001 - third-party code at its limits: record it, keep benchmarking
                    r = {"failed": _one_line(e)}
            if mode == "compiled":
                torch.compiler.reset()  # drop the case's compiled code and what its guards hold
            _free(dev)  # outside the except blocks: the case's cache (and a traceback's frames) are gone
            out[(batch, context)][mode] = r
            echo(format_case(preset, batch, context, cfg.num_hidden_layers, full_layers, mode, r))
    del model
    _free(dev)
    return out


def format_case(preset: str, batch: int, context: int, layers: int, full_layers: int, mode: str, r: dict) -> str:
    head = f"transformers {preset} L{layers}/{full_layers} b={batch} ctx={context} {mode}: "
    if r.get("failed"):
        return head + f"failed ({r['failed']})"
    line = (head + f"{r['ms_per_step']:.3f} ms/step ({r['attn_implementation']}, {r['cache']}"
            + (", CUDA graph" if r["cuda_graph"] else "") + f"), {1e3 / r['ms_per_step']:.1f} tok/s/user; "
            f"prefill {r['prefill_s']:.1f} s (untimed, {r['distinct_sequences']} distinct)")
    if r["compile_s"] is not None:
        line += (f"; compile + {r['warmup_steps']} warm-up steps {r['compile_s']:.1f} s ({r['graphs_compiled']} graphs); "
                 f"its inputs (masks) {r['inputs_ms']:.3f} ms of the step")
    if r["peak_mem_bytes"] is not None:
        line += f"; peak mem {r['peak_mem_bytes'] / 2**30:.1f} GiB"
    if r.get("compiles_in_timed_steps"):
        line += f"; {r['compiles_in_timed_steps']} graphs compiled while timing (raise the warmup)"
    return line

"""``gptoss-fp8 bench prefill``: batch-1 prefill latency of the whole model on our kernels (issue 8).

Latency = prompt in, first-token logits out: ``GptOss.forward(..., last_only=True)`` (the model's
own code) with the ``triton`` ops backend, the lm_head on the LAST position only; weights already
resident on the GPU; median of several runs after warm-up.

The model is built directly on the GPU at real shapes from a synthetic preset's config (20b / 120b)
with random FP8 weights (no disk): FP8 values ~ N(0, 32^2) clipped by the e4m3 range, block scales
1 / (32 sqrt(K)), so dequantized weights have std ~ 1/sqrt(K), and a random router spreads tokens
about evenly over the experts (as a trained one roughly does; routing skew is not modelled).

Activation memory: the MoE (the largest activations: T * top_k rows of H and of I) runs in token
chunks of ``moe_chunk`` (the MoE is per token: chunking changes at most GEMM summation order).

Breakdown: one extra run with CUDA events around every ops call: attention; MoE = router GEMM +
expert FFN + weighted combine; dense = q/k/v/o projections (activation quantization included) +
lm_head; norm = the RMSNorms with their residual adds (after the MoE also its weighted combine,
fused into that pass); other = the rest of the wall time
(embedding, rope, top-k/softmax, launch gaps). Each GEMM part shows its FLOPs, achieved TFLOP/s
and floor (FLOPs at the measured peak, ``PEAK_TFLOPS``).

The transformers peer (``prefill_peer.py``) runs after our model is freed, on the same shapes and
token ids, when transformers is importable (it is on the GPU machine; not a dependency).
"""

from __future__ import annotations

import functools
import math
import re
import statistics
import time
import zlib
from pathlib import Path

import torch

from gptoss_fp8.config import GptOssConfig, preset_config
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.gptoss import GptOss, default_moe_chunk
from gptoss_fp8.parallel import SINGLE, Parallel
from gptoss_fp8.quant.fp8 import FP8_DTYPE

GPU_HOUR_USD = 3.0
# The seed's batch-1 prefill latency on one H200 (issue 8), seconds.
SEED_S = {
    "20b": {8192: 0.239, 32768: 1.610, 65536: 4.895, 128000: 16.04},
    "120b": {8192: 0.364, 32768: 2.421, 65536: 7.375, 128000: 23.90},
}
# transformers GptOss bf16 (flex_attention, grouped_mm) on an H200, from issue 8 (not this run).
TRANSFORMERS_S = {"20b": {8192: 0.228, 32768: 1.121, 65536: 2.601, 128000: 8.128}}
# Issue 8's targets, seconds.
TARGET_S = {"20b": {8192: 0.10, 32768: 0.60, 128000: 5.0}, "120b": {8192: 0.15, 128000: 7.5}}

FP8_SPREAD = 32.0
# Peaks each part's floor is computed against (platform-notes.md, measured on the H200): FP8
# tensorwise ``_scaled_mm`` 8192x5760x2880 for the FP8 GEMMs, the bf16 GEMM 8192^3 for attention.
PEAK_TFLOPS = {"dense": 1137.0, "moe": 1137.0, "attention": 692.0}


def usd_per_million_tokens(latency_s: float, tokens: int, usd_per_hour: float = GPU_HOUR_USD) -> float:
    return latency_s / 3600.0 * usd_per_hour * 1e6 / tokens


# ----------------------------------------------------------------------------------------------
# Random model on the GPU


@torch.no_grad()
def _fill_fp8(t: torch.Tensor, gen: torch.Generator, chunk: int = 1 << 27) -> None:
    flat = t.view(-1)
    for s in range(0, flat.numel(), chunk):
        e = min(s + chunk, flat.numel())
        r = torch.randn(e - s, generator=gen, device=t.device, dtype=torch.float32).mul_(FP8_SPREAD)
        flat[s:e] = r.clamp_(-448, 448).to(FP8_DTYPE)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def repeated_layer(name: str, distinct_layers: int | None) -> str | None:
    """The name of the tensor that ``name`` repeats when only the first ``distinct_layers`` layers
    have weights of their own (layer i takes layer i mod ``distinct_layers``'s), or None when it is
    its own (a tensor outside the layers, or no repetition)."""
    m = _LAYER_NAME.match(name)
    if distinct_layers is None or m is None or int(m.group(1)) < distinct_layers:
        return None
    return f"model.layers.{int(m.group(1)) % distinct_layers}.{m.group(2)}"


@torch.no_grad()
def random_model(cfg: GptOssConfig, device: str | torch.device = "cuda", seed: int = 0, par: Parallel = SINGLE,
                 distinct_layers: int | None = None) -> GptOss:
    """A GptOss (rank ``par`` of its layout) with random weights at cfg's shapes, built on ``device``
    (FP8 attention). Each tensor has its own generator, seeded by (seed, name, and the rank for a
    shard): tensors every rank holds whole (embedding, norms, router, lm_head) are the same on every
    rank, as in a real layout; shards differ. ``distinct_layers``: only the first N layers get
    weights of their own; layer i (i >= N) holds layer i mod N's tensors themselves (no copy), so
    every layer of a model too large for the GPU runs, each reading its weights from memory as the
    whole model's would (a layer's experts are far larger than the L2; ``repeated_layer``)."""
    model = GptOss(cfg, par, attn_fp8=True)
    expected = model.expected()
    whole = expected if par.world == 1 else GptOss(cfg, SINGLE, attn_fp8=True).expected()
    repeats = {}
    for name, (shape, dtype) in expected.items():
        src = repeated_layer(name, distinct_layers)
        if src is not None:
            repeats[name] = src
            continue
        shard = par.rank + 1 if whole.get(name, (None,))[0] != shape else 0
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * shard)
        if dtype == FP8_DTYPE:
            t = torch.empty(shape, dtype=dtype, device=device)
            _fill_fp8(t, gen)
        elif name.endswith("scale_inv"):
            k = expected[name[: -len("_scale_inv")]][0][-1]
            t = torch.full(shape, 1.0 / (FP8_SPREAD * math.sqrt(k)), dtype=dtype, device=device)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        elif name.endswith(("bias", "sinks")):
            t = (0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)).to(dtype)
        else:  # bf16 matrices: router, lm_head
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / math.sqrt(shape[-1])).to(dtype)
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, t)
    for name, src in repeats.items():
        mod_name, _, attr = name.rpartition(".")
        src_mod, _, src_attr = src.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, getattr(model.get_submodule(src_mod), src_attr))
    return model


# ----------------------------------------------------------------------------------------------
# Prefill


def last_layer_rows(model: GptOss, full_last_layer: bool, full_depth: bool) -> str:
    """Set whether the prefill's last layer runs on the last row only past its K / V
    (``GptOss.prune_last_layer``, the model's default) -> the row's "last_layer" label. A model cut
    to fewer layers than its preset (``--layers``) runs every layer on every row: its latency is
    scaled to the full depth, which would count the pruned layer's saving once per cut model."""
    model.prune_last_layer = not full_last_layer and full_depth
    return "last row" if model.prune_last_layer else "every row"


def prefill_logits(model: GptOss, tokens: torch.Tensor, ops, moe_chunk: int | None = None) -> torch.Tensor:
    """tokens int [T] -> logits bf16 [1, V] of the last position (the model's forward, its MoE in chunks of
    ``moe_chunk`` tokens; None: the model's ``default_moe_chunk``)."""
    return model(tokens, ops, last_only=True, moe_chunk=default_moe_chunk(model.cfg) if moe_chunk is None else moe_chunk)


class GraphedPrefill:
    """One prefill of a fixed prompt length captured as a CUDA graph, replayed with new token ids.

    The replay skips the host: no Python, no kernel launch path (~0.1-0.7 ms of host time per
    kernel call on the H200 machine, notes/kernels_gemm.md) and none of the gaps between the ~20
    kernels of a layer. The forward has no host synchronisation and no data-dependent shapes on
    the ``triton`` backend (the MoE sizes its buffers by upper bounds), so the routing of the
    replayed tokens is computed on the GPU as in an eager call. Capture on a warm ``ops`` (kernels
    compiled); the graph keeps its own activation memory (one forward's) until it is dropped.
    A sharded model (``bench prefill --tp --cuda-graph``): every rank captures together, its
    all-reduces NCCL calls inside the graph (model/graph.py ``capture_args``), and every rank
    replays in the same order.
    """

    def __init__(self, model: GptOss, n: int, ops, moe_chunk: int | None = None):
        from gptoss_fp8.model.graph import capture_args

        self.tokens = torch.zeros(n, dtype=torch.long, device=model.model.embed_tokens.weight.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # torch's recipe: one forward on a side stream before capture
            prefill_logits(model, self.tokens, ops, moe_chunk)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, **capture_args(model, self.tokens.device)):
            self.logits = prefill_logits(model, self.tokens, ops, moe_chunk)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int [n] (on the GPU) -> logits [1, V] (the graph's output buffer: clone to keep)."""
        if tokens.shape != self.tokens.shape:
            raise GptOssFp8Error(f"this graph was captured for {self.tokens.shape[0]} tokens, got {tokens.shape[0]}; "
                                 "capture one per prompt length")
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


class TimedOps:
    """Delegates to ``ops``, timing each call by part: CUDA events on a GPU (no host sync per
    call), the host clock on CPU (the ops there are synchronous)."""

    def __init__(self, ops, num_experts: int, cuda: bool = True):
        self.ops, self.num_experts, self.cuda = ops, num_experts, cuda
        self.events: list[tuple[str, object, object]] = []
        self.attention_windows: dict[int, int] = {}  # event index -> window, for each prefill attention call

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _timed(self, part, fn, *a, **kw):
        s = self._now()
        out = fn(*a, **kw)
        self.events.append((part, s, self._now()))
        return out

    # ops method -> breakdown part (``linear`` is split by its weight below); anything else the
    # model calls runs untimed and lands in "other"
    PARTS = {"linears": "dense", "linears_q8": "dense", "linear_add": "dense", "route": "moe", "expert_ffn": "moe",
             "moe_combine": "moe", "moe_combine_add_rms_norm": "norm", "rms_norm": "norm", "add_rms_norm": "norm",
             "attention": "attention", "attention_out": "attention", "attention_cached": "attention",
             "attention_chunk": "attention",
             "attention_segments": "attention"}

    def __getattr__(self, name):
        if name == "ops":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        fn = getattr(self.ops, name)
        part = self.PARTS.get(name)
        return fn if part is None else functools.partial(self._timed, part, fn)

    def _attention(self, fn, kind: int, *a, **kw):
        """A timed attention call, its layer kind recorded for ``attention_by_layer_kind`` (the window; -1: a last
        row's or a later chunk's)."""
        out = self._timed("attention", fn, *a, **kw)
        self.attention_windows[len(self.events) - 1] = kind
        return out

    def attention(self, q, k, v, sinks, sm_scale, window, rope=None):
        return self._attention(self.ops.attention, int(window), q, k, v, sinks, sm_scale, window, rope=rope)

    def attention_out(self, q, k, v, sinks, sm_scale, window, rope=None, rows=True):
        return self._attention(self.ops.attention_out, int(window), q, k, v, sinks, sm_scale, window, rope=rope,
                               rows=rows)

    def attention_chunk(self, q, k, v, sinks, sm_scale, window, q_offset):
        return self._attention(self.ops.attention_chunk, -1, q, k, v, sinks, sm_scale, window, q_offset)

    def attention_segments(self, q, k, v, sinks, sm_scale, window, keys):
        return self._attention(self.ops.attention_segments, int(window), q, k, v, sinks, sm_scale, window, keys)

    def attention_cached(self, q, k_cache, v_cache, lengths, sinks, sm_scale, window):
        return self._attention(self.ops.attention_cached, -1, q, k_cache, v_cache, lengths, sinks, sm_scale, window)

    def attention_by_layer_kind(self) -> dict[str, dict[str, float]]:
        """The prefill attention calls' time split by layer kind: {"full" | "window" | "last row": {"s":
        seconds, "calls": n}} (full: no window; last row: the pruned last layer's query, ``attention_cached``
        / ``attention_chunk``; the kinds with no call left out)."""
        out: dict[str, dict[str, float]] = {}
        for i, window in self.attention_windows.items():
            _, s, e = self.events[i]
            kind = "last row" if window < 0 else "window" if window else "full"
            d = out.setdefault(kind, {"s": 0.0, "calls": 0})
            d["s"] += self._dt(s, e)
            d["calls"] += 1
        return out

    def _dt(self, s, e) -> float:
        return s.elapsed_time(e) / 1e3 if self.cuda else e - s

    def linear(self, x, w, scale_inv, bias, out_dtype=torch.bfloat16, *, xq=None):
        part = "moe" if (w.dtype != FP8_DTYPE and w.shape[0] == self.num_experts) else "dense"
        return self._timed(part, self.ops.linear, x, w, scale_inv, bias, out_dtype, xq=xq)

    def all_reduce(self, t, par):
        """Timed as "allreduce" on a sharded model (an identity on one rank: not a part)."""
        if par.world == 1:
            return self.ops.all_reduce(t, par)
        return self._timed("allreduce", self.ops.all_reduce, t, par)

    def all_gather(self, t, par, sizes=None):
        """Timed as "allgather" (the vocab-parallel logits) on a sharded model."""
        if par.world == 1:
            return self.ops.all_gather(t, par, sizes)
        return self._timed("allgather", self.ops.all_gather, t, par, sizes)

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for part, s, e in self.events:
            out[part] = out.get(part, 0.0) + self._dt(s, e)
        return out


def part_flops(cfg: GptOssConfig, n: int, last_row: bool = False) -> dict[str, float]:
    """FLOPs per part for an n-token prefill (2 per multiply-add; causal attention counts the
    visible half, windowed layers the window). ``last_row``: the last layer's queries, o_proj and
    MoE on the last row only (``GptOss.prune_last_layer``), its K / V on every row."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dense = moe = attn = 0.0
    for i, lt in enumerate(cfg.layer_types):
        m = 1 if last_row and i == cfg.num_hidden_layers - 1 else n  # the rows past K / V
        dense += 2 * n * h * 2 * hkv * d + 2 * m * h * 2 * hq * d
        moe += 2 * m * (h * cfg.num_local_experts + cfg.num_experts_per_tok * 3 * h * cfg.intermediate_size)
        w = cfg.sliding_window if lt == "sliding_attention" and cfg.sliding_window > 0 else n
        w = min(w, n)
        # query i sees min(i + 1, w) keys; the last row alone: w
        pairs = w if m == 1 else w * (w + 1) / 2 + (n - w) * w
        attn += 4 * pairs * hq * d
    return {"attention": attn, "moe": moe, "dense": dense + 2 * h * cfg.vocab_size}


def pruned_layer_saving(full_cfg: GptOssConfig, parts: dict[str, float], by_kind: dict, cut_layers: int) -> float:
    """What the whole model's pruned last layer (``GptOss.prune_last_layer``: its queries, o_proj and MoE on the last
    row only) saves against a layer on every row, estimated from a model cut to ``cut_layers`` layers that ran every
    layer on every row (``parts``: one run's seconds a part, ``by_kind``: ``TimedOps.attention_by_layer_kind``): one
    attention call of the last layer's kind, one layer's MoE, o_proj's share of one layer's dense GEMMs and half a
    layer's norms. A cut model's latency scaled to the full depth, less this, estimates the whole model's."""
    kind = "window" if full_cfg.layer_types[-1] == "sliding_attention" else "full"
    att = by_kind.get(kind)
    attn = att["s"] / att["calls"] if att and att["calls"] else 0.0
    hq, hkv = full_cfg.num_attention_heads, full_cfg.num_key_value_heads
    o_share = hq / (2 * hq + 2 * hkv)  # (o_proj's FLOPs of q / k / v + o_proj's, the per-row hidden size cancels)
    per_layer = {p: parts.get(p, 0.0) / cut_layers for p in ("moe", "dense", "norm")}
    return attn + per_layer["moe"] + o_share * per_layer["dense"] + 0.5 * per_layer["norm"]


def full_depth_estimate(lat: float, total: float, parts: dict[str, float], by_kind: dict, cut_layers: int,
                        full_cfg: GptOssConfig, full_last_layer: bool) -> tuple[float, float]:
    """A cut model's median latency ``lat`` scaled to ``full_cfg``'s depth -> (estimate, saving): less the whole
    model's pruned last layer (``pruned_layer_saving``, in the median's terms: the events run's ``total`` seconds
    times lat / total) unless the last layer runs on every row (``full_last_layer``) or nothing was cut."""
    scale = full_cfg.num_hidden_layers / cut_layers
    saving = 0.0
    if scale != 1 and not full_last_layer and total > 0:
        saving = pruned_layer_saving(full_cfg, parts, by_kind, cut_layers) * lat / total
    return lat * scale - saving, saving


WARMUP_S = 2.0


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench(preset: str, token_list: list[int], layers: int | None = None, runs: int = 5, warmup: int = 2,
          moe_chunk: int | None = None, seed: int = 0, peer: bool = True, peer_runs: int = 3, echo=print,
          checkpoint: Path | None = None, cuda_graph: bool = False, kernel_config=None,
          attention: str = "bf16", full_last_layer: bool = False, distinct_layers: int | None = None) -> list[dict]:
    """One row per token count: median latency, $/1M tokens, seed figures, floor, breakdown, and
    (``peer``, when transformers is importable) transformers' bf16 GptOss on the same shapes and
    tokens in the same run, after our model is freed. ``checkpoint``: time a converted (tp=1)
    checkpoint's own weights instead of random ones at the preset's shapes. ``cuda_graph``: also
    the same forward captured as a CUDA graph per length (``GraphedPrefill``), timed after the
    eager runs (the row's ``latency_s`` stays the eager figure). ``kernel_config``: the kernels'
    ``KernelConfig`` (None: ``TritonOps``' default). ``attention``: prefill attention's numerics,
    "bf16" or "fp8" (the FP8 Triton kernel, operands quantized per call; the row's ``attention``; the
    attention floor stays the bf16 one). ``full_last_layer``: the last layer on every row, not only on
    the last past its K / V (``last_layer_rows``; the row's ``last_layer``). ``moe_chunk``: tokens per MoE call
    (None: the model's ``default_moe_chunk``; the row's ``moe_chunk``). ``distinct_layers``: weights of
    their own for the first N layers only, repeated through the rest (``random_model``): every layer
    runs, on a GPU that cannot hold them all (the row's ``distinct_layers``)."""
    from gptoss_fp8.model.triton_ops import TritonOps

    t0 = time.perf_counter()
    if checkpoint is not None:
        if distinct_layers is not None:
            raise GptOssFp8Error("--distinct-layers repeats random weights at a preset's shapes; a --checkpoint "
                                 "brings its own weights for every layer")
        model = load_checkpoint(checkpoint, layers)
        cfg = model.cfg
        preset = matching_preset(cfg) or Path(checkpoint).name
        # a preset cut to fewer layers is scaled to the preset's depth, as --layers is
        full_cfg = preset_config(preset) if preset in SEED_S else cfg
        what = f"{checkpoint} (converted checkpoint; shapes of the {preset} preset)" if preset in SEED_S else str(checkpoint)
    else:
        cfg = preset_config(preset, layers)
        full_cfg = preset_config(preset)
        distinct_layers = check_distinct_layers(distinct_layers, cfg)
        check_fits(cfg, f"{preset} with {cfg.num_hidden_layers} layers", distinct_layers=distinct_layers)
        model = random_model(cfg, "cuda", seed, distinct_layers=distinct_layers)
        what = preset + distinct_text(distinct_layers)
    full_layers = full_cfg.num_hidden_layers
    torch.cuda.synchronize()
    echo(f"# {what}: {cfg.num_hidden_layers} of {full_layers} layers on {torch.cuda.get_device_name()} in "
         f"{time.perf_counter() - t0:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB resident")
    from gptoss_fp8.kernels.config import kernel_paths

    last_layer = last_layer_rows(model, full_last_layer, cfg.num_hidden_layers == full_layers)
    echo(f"# last layer past its K / V: {last_layer}")
    moe_chunk = default_moe_chunk(cfg) if moe_chunk is None else moe_chunk
    echo(f"# MoE in chunks of up to {moe_chunk} tokens")
    ops = TritonOps(config=kernel_config).with_attention(attention)
    if attention != "bf16":
        echo(f"# attention: {attention} in the full-attention layers (Q, K, V and P in e4m3, spec.attention_fp8"
             + (", P's codes from the scores without 2^x" if attention == "fp8-lin" else "") + "), "
             "bf16 in the sliding-window layers and in the last layer's one query (the decode attention)")
    if ops.config.gemm == "deep_gemm":  # DeepGEMM's K-padded weights replace ours: no second copy
        from gptoss_fp8.kernels.deepgemm import adopt_padded

        echo(f"# deep_gemm: weights K-padded in place, +{adopt_padded(model) / 2**30:.2f} GiB")
    echo(f"# {kernel_paths(torch.device('cuda'), ops.config)}")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    for n in token_list:
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        # warm-up: at least ``warmup`` forwards and WARMUP_S seconds of them (GPU clocks settle; a
        # short prompt's two forwards are ~0.2 s)
        w0, done = time.perf_counter(), 0
        while done < warmup or (time.perf_counter() - w0 < WARMUP_S and done < 50):
            prefill_logits(model, tokens, ops, moe_chunk)
            torch.cuda.synchronize()
            done += 1
        times = [_sync_time(lambda tokens=tokens: prefill_logits(model, tokens, ops, moe_chunk)) for _ in range(runs)]
        lat = statistics.median(times)
        timed = TimedOps(ops, cfg.num_local_experts)
        total = _sync_time(lambda tokens=tokens, timed=timed: prefill_logits(model, tokens, timed, moe_chunk))
        parts = timed.seconds()
        parts["other"] = max(total - sum(parts.values()), 0.0)
        flops = part_flops(cfg, n, model.prune_last_layer)
        floor = {p: flops[p] / (PEAK_TFLOPS[p] * 1e12) for p in flops}
        # (a cut model runs its last layer on every row; the whole model, unless full_last_layer, prunes it)
        est, saving = full_depth_estimate(lat, total, parts, timed.attention_by_layer_kind(), cfg.num_hidden_layers,
                                          full_cfg, full_last_layer)
        row = {
            "model": preset, "tokens": n, "layers": cfg.num_hidden_layers, "full_layers": full_layers,
            "latency_s": lat, "runs_s": times, "est_full_s": est, "est_pruned_saving_s": saving,
            "usd_per_1m_tokens": usd_per_million_tokens(est, n),
            "seed_s": SEED_S.get(preset, {}).get(n), "transformers_issue_s": TRANSFORMERS_S.get(preset, {}).get(n),
            "target_s": TARGET_S.get(preset, {}).get(n),
            "floor_s": sum(floor.values()), "parts_floor_s": floor,
            "parts_s": parts, "parts_total_s": total, "attention_by_kind": timed.attention_by_layer_kind(),
            "parts_tflops": {p: flops[p] / parts[p] / 1e12 for p in flops if parts.get(p)},
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "transformers_s": None, "transformers_note": None, "attention": attention, "last_layer": last_layer,
            "moe_chunk": moe_chunk, "distinct_layers": distinct_layers,
        }
        if cuda_graph:
            row.update(_graph_timing(model, tokens, ops, moe_chunk, runs))
        rows.append(row)
        echo(format_row(row))
        del tokens
    model = ops = None  # free the weights before the peer builds its own
    torch.cuda.empty_cache()
    if peer and preset in SEED_S:
        _add_peer(rows, preset, cfg.num_hidden_layers, token_list, peer_runs, seed, echo)
    elif peer:
        echo(f"# transformers peer not run: {checkpoint} has no preset's shapes")
    return rows


def _graph_timing(model: GptOss, tokens: torch.Tensor, ops, moe_chunk: int | None, runs: int) -> dict:
    """Capture the prefill as a CUDA graph and time its replays (tokens copied in included)."""
    eager = prefill_logits(model, tokens, ops, moe_chunk)
    torch.cuda.empty_cache()  # the graph allocates its own pool
    t0 = time.perf_counter()
    graphed = GraphedPrefill(model, tokens.shape[0], ops, moe_chunk)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    got = graphed(tokens).clone()
    w0 = time.perf_counter()
    while time.perf_counter() - w0 < WARMUP_S / 2:
        graphed(tokens)
        torch.cuda.synchronize()
    times = [_sync_time(lambda g=graphed: g(tokens)) for _ in range(runs)]
    diff = ((got.float() - eager.float()).norm() / eager.float().norm()).item()
    del graphed
    torch.cuda.empty_cache()
    return {"graph_latency_s": statistics.median(times), "graph_runs_s": times, "graph_capture_s": capture_s,
            "graph_vs_eager_rel": diff}


def matching_preset(cfg: GptOssConfig) -> str | None:
    """The synthetic preset (20b / 120b) with cfg's shapes (any depth), or None."""
    from dataclasses import replace

    for name in SEED_S:
        p = preset_config(name, cfg.num_hidden_layers)
        if replace(p, layer_types=cfg.layer_types) == cfg:
            return name
    return None


def weight_bytes(cfg: GptOssConfig, par: Parallel = SINGLE, distinct_layers: int | None = None) -> int:
    """Bytes of one rank's tensors (FP8 experts and attention, bf16 embeddings and lm_head; the
    whole model at tp 1); with ``distinct_layers``, those ``random_model`` allocates (repeated
    layers hold no bytes of their own)."""
    return sum(math.prod(shape) * dtype.itemsize for name, (shape, dtype) in GptOss(cfg, par, attn_fp8=True).expected().items()
               if repeated_layer(name, distinct_layers) is None)


def check_fits(cfg: GptOssConfig, what: str, device: str = "cuda", par: Parallel = SINGLE, sharers: int = 1,
               distinct_layers: int | None = None) -> None:
    """One-line error when the weights alone (of rank ``par``, times the ``sharers`` ranks on its
    GPU; of ``distinct_layers`` layers repeated) cannot fit the GPU's free memory."""
    need = weight_bytes(cfg, par, distinct_layers) * sharers
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need > free:
        who, more = "", ""
        if par.world > 1:
            who = f" at tp {par.tp} ep {par.ep}: rank {par.rank}" + (f" ({sharers} ranks on one GPU)" if sharers > 1 else "")
            more = ", or a larger --tp"
        if distinct_layers is not None:
            more = " or a smaller --distinct-layers"
        elif par.world == 1:
            more = ", or --distinct-layers N to run every layer on N layers' weights"
        raise GptOssFp8Error(f"{what}{who} needs {need / 2**30:.1f} GiB of weights, {free / 2**30:.1f} GiB are free on "
                             f"the GPU; pass --layers N to build fewer layers{more}")


def check_distinct_layers(distinct_layers: int | None, cfg: GptOssConfig) -> int | None:
    """``--distinct-layers`` checked against the layers built -> N, or None where every layer has its own
    weights anyway (N = the depth)."""
    if distinct_layers is None:
        return None
    if distinct_layers < 1 or distinct_layers > cfg.num_hidden_layers:
        raise GptOssFp8Error(f"--distinct-layers {distinct_layers}: the model has {cfg.num_hidden_layers} layers; "
                             f"pass 1 to {cfg.num_hidden_layers}")
    return None if distinct_layers == cfg.num_hidden_layers else distinct_layers


def repeated_text(distinct_layers: int) -> str:
    """A row's note of ``--distinct-layers N``."""
    return f"weights of {distinct_layers} layer{'s' * (distinct_layers > 1)}, repeated"


def distinct_text(distinct_layers: int | None) -> str:
    """The model line's note of repeated weights ("" for none)."""
    if distinct_layers is None:
        return ""
    return (f" (weights of its first {distinct_layers} layers repeated through the rest: each layer reads its "
            "weights from memory as the whole model's would; timing only, not a model's logits)")


def load_checkpoint(checkpoint: Path, layers: int | None) -> GptOss:
    """A converted checkpoint's tp=1 layout on the GPU (all layers: --layers does not apply)."""
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.model.load import load_model

    if layers is not None:
        raise GptOssFp8Error("--layers builds random weights at a preset's shapes; with --checkpoint the whole model runs")
    ckpt = Checkpoint.open(checkpoint)
    ckpt.resolve_layout(1, 1)  # one GPU: the tp=1 layout
    return load_model(ckpt, SINGLE, "cuda")


def _add_peer(rows: list[dict], preset: str, layers: int, token_list: list[int], runs: int, seed: int, echo) -> None:
    """transformers' bf16 GptOss on the same shapes (same token ids), its median beside ours."""
    from gptoss_fp8.bench import prefill_peer

    why = prefill_peer.transformers_available()
    if why is not None:
        echo(f"# transformers peer not run: {why}")
        for r in rows:
            r["transformers_note"] = why
        return
    res = prefill_peer.bench_peer(preset, token_list, layers=layers, runs=runs, warmup=1, seed=seed, echo=echo)
    for r in rows:
        got = res.get(r["tokens"]) or {}
        r["transformers_note"] = got.get("error")
        if got.get("median_s") is not None:
            r["transformers_s"] = got["median_s"]
            r["transformers_runs_s"] = got.get("runs_s")
            r["vs_transformers"] = got["median_s"] / r["latency_s"]  # same layers on both sides
        echo(format_peer(r))


def format_peer(r: dict) -> str:
    if r.get("transformers_s") is None:
        return f"{r['model']} | {r['tokens']} tok | transformers bf16: {r.get('transformers_note') or 'not measured'}"
    return (f"{r['model']} | {r['tokens']} tok | layers {r['layers']}/{r['full_layers']} | transformers bf16 (this run) "
            f"{r['transformers_s']:.4f} s vs ours {r['latency_s']:.4f} s: x{r['vs_transformers']:.2f}")


def est_text(r: dict) -> str:
    """A cut model's row: " | full-model est X s", with what the whole model's pruned last layer took off."""
    if r["layers"] == r["full_layers"]:
        return ""
    saving = r.get("est_pruned_saving_s")
    return f" | full-model est {r['est_full_s']:.4f} s" + (f" (less the pruned last layer's {saving:.3f} s)" if saving else "")


def format_row(r: dict) -> str:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    est = r["est_full_s"]
    head = (f"{r['model']} | {r['tokens']} tok | layers {r['layers']}/{r['full_layers']} | "
            f"latency {r['latency_s']:.4f} s" + est_text(r)
            + f" | ${r['usd_per_1m_tokens']:.4f}/1M tok | "
            f"seed {f(r['seed_s'])} s (x{f(r['seed_s'] / est if r['seed_s'] else None, '{:.2f}')}) | "
            f"transformers (issue) {f(r['transformers_issue_s'])} s | target {f(r['target_s'])} s | "
            f"floor {r['floor_s']:.4f} s (latency / floor x{r['latency_s'] / r['floor_s']:.2f}) | "
            f"peak mem {r['peak_mem_gib']:.1f} GiB" + (f" | last layer: {r['last_layer']}" if r.get("last_layer") else "")
            + (f" | {repeated_text(r['distinct_layers'])}" if r.get("distinct_layers") else ""))
    if r.get("graph_latency_s") is not None:
        head += (f"\n  CUDA graph: latency {r['graph_latency_s']:.4f} s (eager / graph "
                 f"x{r['latency_s'] / r['graph_latency_s']:.3f}; "
                 f"capture {r['graph_capture_s']:.2f} s; logits vs eager rel {r['graph_vs_eager_rel']:.1e})")
    tot = r["parts_total_s"]
    parts = " | ".join(
        f"{p} {r['parts_s'].get(p, 0) * 1e3:.2f} ms ({100 * r['parts_s'].get(p, 0) / tot:.0f}%"
        + (f", {r['parts_tflops'][p]:.0f} TFLOP/s, floor {r['parts_floor_s'][p] * 1e3:.2f} ms" if p in r["parts_tflops"] else "")
        + ")"
        for p in ("attention", "moe", "dense", "norm", "allreduce", "allgather", "other")
        if p not in ("allreduce", "allgather") or p in r["parts_s"])
    kinds = r.get("attention_by_kind") or {}
    if kinds:
        parts += " | attention by layer: " + ", ".join(
            f"{k} {kinds[k]['s'] * 1e3:.2f} ms / {kinds[k]['calls']} = {kinds[k]['s'] * 1e3 / kinds[k]['calls']:.2f} ms each"
            for k in ("full", "window", "last row") if k in kinds)
    return head + "\n  breakdown (one run with events, " + f"{tot * 1e3:.2f} ms): " + parts

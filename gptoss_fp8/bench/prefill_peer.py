"""The peer for ``gptoss-fp8 bench prefill``: what users run today, measured in the same way.

Measured: batch-1 prefill latency of Hugging Face transformers' ``GptOssForCausalLM`` in bf16 at a
synthetic preset's real shapes (random weights, built on the GPU, resident), prompt in -> logits of
the LAST position out (``logits_to_keep=1``, ``use_cache=False``: a forward, no KV cache kept),
``torch.cuda.synchronize()`` around each run, median of ``runs`` after ``warmup`` untimed runs
(the first compiles FlexAttention and its block mask). ``bench_peer`` resets torch.compile's caches
before each prompt length, so each is timed with the static-shape kernels it would get as the
first length of a process (the peer's best case; see the comment there).

Implementations, as transformers 5.17 picks them for gpt-oss in bf16 (see ``build_peer``):
attention ``flex_attention`` (sinks folded in through the LSE; ``sdpa`` is not offered for gpt-oss,
and flex refuses sinks on CPU), experts ``grouped_mm`` (transformers' default whenever the model
class uses ``@use_experts_implementation``: tokens sorted by expert, one ``torch.nn.functional.
grouped_mm`` for gate_up and one for down, bias added after). The block mask and the rotary
tables are built inside every forward, as for any user. A length that runs out of memory is
recorded as ``"out of memory"``, not fatal (a bare FlexAttention block mask has been seen to at
128000 tokens; through transformers the 20b ran there on an H200, 69 GiB peak).

Random weights at sane scales: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1, biases
and sinks ~ N(0, 0.02^2); routing over random weights is about even (as in ``bench/prefill.py``).
``load_from_ours`` instead copies the weights of one of our models (FP8 dequantized as our
``ReferenceOps`` does), so the two can be checked against each other.

transformers is NOT a dependency of this project: it is imported only here, only when asked, and
its absence is reported (``transformers_available``) rather than raised. The tests of this module
(tests/test_prefill_peer.py) skip where it is not installed, so they do not run in CI.

Run alone: ``python -m gptoss_fp8.bench.prefill_peer --model 20b --tokens 8192,32768 [--layers N]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gptoss_fp8.config import GptOssConfig
from gptoss_fp8.errors import GptOssFp8Error

if TYPE_CHECKING:  # transformers is optional; never imported at module load
    from gptoss_fp8.model.gptoss import GptOss

# The version the peer figures were measured with (the GPU machine's); others may work.
TRANSFORMERS_VERSION = "5.17.0"
DEFAULT_ATTN = "flex_attention"
DEFAULT_EXPERTS = "grouped_mm"
# HF stores expert weights as [E, in, out] (ours: [E, out, in]).
_EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def transformers_available() -> str | None:
    """None if transformers' gpt-oss model with grouped_mm experts can be used here, else why not (one line)."""
    try:
        import transformers
        from transformers import GptOssForCausalLM  # noqa: F401
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        return f"transformers is not importable ({e}); pip install transformers=={TRANSFORMERS_VERSION}"
    if DEFAULT_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        return (f"transformers {transformers.__version__} has no {DEFAULT_EXPERTS} experts; "
                f"pip install transformers=={TRANSFORMERS_VERSION}")
    return None


def hf_config(cfg: GptOssConfig, attn_implementation: str = DEFAULT_ATTN, experts_implementation: str = DEFAULT_EXPERTS):
    """A ``transformers.GptOssConfig`` with cfg's shapes (what from_pretrained would read from the
    checkpoint's config.json), attention and expert implementations set, no quantization."""
    from transformers import GptOssConfig as HfGptOssConfig

    rope = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    rope["rope_theta"] = cfg.rope_theta
    return HfGptOssConfig(
        num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_local_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        vocab_size=cfg.vocab_size,
        sliding_window=cfg.sliding_window,
        rope_parameters=rope,
        rms_norm_eps=cfg.rms_norm_eps,
        # Kept on the config as the released config.json has it, but transformers' experts ignore
        # it (GptOssExperts.limit is 7.0 in code): build_peer sets the limit on every layer.
        swiglu_limit=cfg.swiglu_limit,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=True,
        use_cache=False,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )


def peer_weight_bytes(cfg: GptOssConfig) -> int:
    """Bytes of the peer's bf16 parameters (2 per value)."""
    h, i, e, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attn = (h + 1) * (q + 2 * kv) + (q + 1) * h + cfg.num_attention_heads
    moe = (h + 1) * e + e * ((h + 1) * 2 * i + (i + 1) * h)
    layer = attn + moe + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return 2 * (cfg.num_hidden_layers * layer + embed + h)


@torch.no_grad()
def _fill_normal(t: torch.Tensor, std: float, gen: torch.Generator, chunk: int = 1 << 27) -> None:
    """t <- N(0, std^2), drawn in fp32 chunks (bounded temporary memory), rounded to t's dtype."""
    flat = t.view(-1)
    for s in range(0, flat.numel(), chunk):
        e = min(s + chunk, flat.numel())
        flat[s:e] = torch.randn(e - s, generator=gen, device=t.device, dtype=torch.float32).mul_(std)


@torch.no_grad()
def build_peer(cfg: GptOssConfig, device: str | torch.device = "cuda", seed: int = 0,
               attn_implementation: str = DEFAULT_ATTN, experts_implementation: str = DEFAULT_EXPERTS):
    """transformers' ``GptOssForCausalLM`` at cfg's shapes, bf16, random weights, built on ``device``
    directly (parameters are allocated there in bf16; nothing is materialised in fp32 on the host),
    in eval mode. The rotary buffers (fp32 ``inv_freq``) are computed by transformers itself.

    Raises GptOssFp8Error when transformers is not usable (check ``transformers_available`` first)."""
    reason = transformers_available()
    if reason:
        raise GptOssFp8Error(reason)
    from transformers import AutoModelForCausalLM

    hcfg = hf_config(cfg, attn_implementation, experts_implementation)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp.experts.limit = cfg.swiglu_limit
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("bias", "sinks")):
            _fill_normal(p, 0.02, gen)
        elif name.endswith("embed_tokens.weight"):
            _fill_normal(p, 1.0, gen)
        elif name.endswith(_EXPERT_WEIGHTS):  # [E, in, out]
            _fill_normal(p, p.shape[-2] ** -0.5, gen)
        else:  # nn.Linear [out, in]: attention projections, router, lm_head
            _fill_normal(p, p.shape[-1] ** -0.5, gen)
    return model


@torch.no_grad()
def load_from_ours(peer, ours: GptOss) -> None:
    """Copy the weights of our (unsharded) model into the peer, FP8 weights dequantized to bf16
    exactly as ``ReferenceOps.weight`` does, expert weights transposed to HF's [E, in, out]."""
    from gptoss_fp8.model.ops import ReferenceOps

    assert ours.par.world == 1, f"load_from_ours needs an unsharded model, got world {ours.par.world}"
    ops = ReferenceOps()
    src = dict(ours.named_buffers())
    for name, p in peer.named_parameters():
        assert name in src, f"peer parameter {name} has no counterpart in our model"
        w = ops.weight(src[name], src.get(name + "_scale_inv"))
        if name.endswith(_EXPERT_WEIGHTS):
            w = w.transpose(-1, -2)
        assert tuple(w.shape) == tuple(p.shape), f"{name}: ours {tuple(w.shape)} vs peer {tuple(p.shape)}"
        p.copy_(w)


def peer_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens int [T] (one prompt) -> bf16 logits [1, 1, V] of the last position."""
    ids = tokens.reshape(1, -1).to(device=model.device, dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer_prefill_seconds(model, tokens: torch.Tensor, runs: int = 3, warmup: int = 2) -> list[float]:
    """Seconds of each of ``runs`` timed prefills (after ``warmup`` untimed ones), synchronized."""
    device = model.device
    ids = tokens.reshape(1, -1).to(device=device, dtype=torch.long)
    for _ in range(warmup):
        peer_logits(model, ids)
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        peer_logits(model, ids)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    if "out of memory" in str(e).lower():
        return f"out of memory ({type(e).__name__})"
    return f"{type(e).__name__}: {first[:300]}"


def start_peer(preset: str, cfg: GptOssConfig, dev: torch.device, seed: int, attn_implementation: str):
    """(the peer built on ``dev``, None), or (None, why not in one line): transformers missing, no
    GPU, bf16 weights that do not fit, out of memory or a failure inside transformers while
    building (memory freed then). The prefill and decode peers' common start."""
    reason = transformers_available()
    if reason:
        return None, reason
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None, "needs a CUDA GPU; none is visible"
        free, _ = torch.cuda.mem_get_info(dev)
        need = peer_weight_bytes(cfg)
        if need > free:
            return None, (f"{preset} with {cfg.num_hidden_layers} layers needs {need / 1e9:.0f} GB of bf16 weights, "
                          f"{free / 1e9:.0f} GB free on the GPU; pass --layers")
    try:
        model = build_peer(cfg, dev, seed, attn_implementation)
    except torch.cuda.OutOfMemoryError:
        reason = "out of memory building the model"
    except Exception as e:  # noqa: BLE001 - e.g. an attn_implementation transformers refuses for gpt-oss
        reason = _one_line(e)
    if reason:
        _free(dev)
        return None, reason
    _sync(dev)
    return model, None


def bench_peer(preset: str, token_list: list[int], layers: int | None = None, runs: int = 3, warmup: int = 2,
               seed: int = 0, echo=print, device: str = "cuda",
               attn_implementation: str = DEFAULT_ATTN) -> dict[int, dict]:
    """Peer latency per prompt length: ``{tokens: {"median_s", "runs_s", "peak_mem_gib", "error"}}``.

    Never raises for the peer's sake: transformers missing, no GPU, weights that do not fit, out of
    memory or any failure inside transformers at one length give that length (or every length) an
    ``error`` line and ``median_s`` None. Only a bad preset / layers value raises GptOssFp8Error."""
    from gptoss_fp8.config import preset_config

    cfg = preset_config(preset, layers)
    full_layers = preset_config(preset).num_hidden_layers
    out = {n: {"median_s": None, "runs_s": [], "peak_mem_gib": None, "error": None} for n in token_list}
    dev = torch.device(device)

    def fail_all(reason: str) -> dict[int, dict]:
        echo(f"# transformers peer: {reason}")
        for r in out.values():
            r["error"] = reason
        return out

    t0 = time.perf_counter()
    model, reason = start_peer(preset, cfg, dev, seed, attn_implementation)
    if reason:
        return fail_all(reason)
    import transformers

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    echo(f"# transformers {transformers.__version__} GptOssForCausalLM bf16 ({attn_implementation}, "
         f"{model.config._experts_implementation} experts): {preset}, {cfg.num_hidden_layers} of {full_layers} layers "
         f"built on {where} in {time.perf_counter() - t0:.1f} s, {peer_weight_bytes(cfg) / 2**30:.1f} GiB of weights")
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    for n in token_list:
        r = out[n]
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen, device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        # Compile afresh for each length: static-shape kernels, as for a process's first length.
        # Otherwise the second length recompiles with dynamic shapes and later lengths are slower
        # (measured on an H200, 20b at 65536 tokens: 2.90 s after 8192 and 32768, 2.60 s alone).
        torch.compiler.reset()
        try:
            r["runs_s"] = peer_prefill_seconds(model, tokens, runs, warmup)
        except torch.cuda.OutOfMemoryError:
            r["error"] = "out of memory"
        except Exception as e:  # noqa: BLE001 - third-party code at its limits: record it, keep benchmarking
            r["error"] = _one_line(e)
        if r["error"]:
            _free(dev)  # outside the except block, so the traceback's frames (and tensors) are gone
        else:
            r["median_s"] = statistics.median(r["runs_s"])
        if dev.type == "cuda":
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        echo(format_peer(preset, n, cfg.num_hidden_layers, full_layers, r))
    del model
    _free(dev)
    return out


def format_peer(preset: str, n: int, layers: int, full_layers: int, r: dict) -> str:
    head = f"transformers {preset} | {n} tok | layers {layers}/{full_layers} | "
    if r["error"]:
        return head + r["error"]
    line = head + f"median {r['median_s']:.4f} s | runs " + ", ".join(f"{t:.4f}" for t in r["runs_s"])
    if layers != full_layers:
        line += f" | full-model est {r['median_s'] * full_layers / layers:.4f} s"
    if r["peak_mem_gib"] is not None:
        line += f" | peak mem {r['peak_mem_gib']:.1f} GiB"
    return line


def main(argv: list[str] | None = None) -> int:
    from gptoss_fp8.config import PRESETS

    p = argparse.ArgumentParser(prog="python -m gptoss_fp8.bench.prefill_peer",
                                description="Batch-1 prefill latency of transformers' GptOssForCausalLM (bf16, "
                                            "random weights at a preset's real shapes): the peer of bench prefill.")
    p.add_argument("--model", default="20b", choices=list(PRESETS), help="synthetic preset whose shapes to build")
    p.add_argument("--tokens", default="8192,32768", help="comma-separated prompt lengths")
    p.add_argument("--layers", type=int, default=None, help="build only the first N layers")
    p.add_argument("--runs", type=int, default=3, help="timed runs per length (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default=DEFAULT_ATTN, help="transformers attn_implementation (flex_attention, eager)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        token_list = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        print(f"error: --tokens {args.tokens!r} is not a comma-separated list of integers", file=sys.stderr)
        return 1
    if not token_list or min(token_list) < 1 or args.runs < 1 or args.warmup < 0:
        print("error: --tokens needs positive lengths, --runs >= 1, --warmup >= 0", file=sys.stderr)
        return 1
    try:
        res = bench_peer(args.model, token_list, args.layers, args.runs, args.warmup, args.seed,
                         device=args.device, attn_implementation=args.attn)
    except GptOssFp8Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.write_text(json.dumps({str(n): r for n, r in res.items()}, indent=1))
    return 0 if any(r["median_s"] is not None for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

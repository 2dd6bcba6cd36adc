"""What deleting one kernel family from the whole prefill would save (issue 34): the ceiling of any fusion of it.

Usage (GPU machine): python3 benchmarks/skip_probe.py --model 20b --tokens 32768 --attention fp8 \\
    [--probes act_quant,router,norm,qk_quant,v_quant,gather,window,rope] [--rounds 3 --block 3]

A probe records the outputs of every call of one function in one forward (cloned, in call order), then replays
them in later forwards without launching anything: the kernels downstream read exactly the tensors they read in
the real forward, so the logits stay equal (checked, rel 0) and the time saved is what removing that kernel's
whole launch costs the rest, at the power cap as it runs (a memory-bound kernel's time is not all energy budget:
the question this answers before a fusion is built). The recorded calls are also timed with CUDA events (the
family's own time in the forward). Default and probe forwards run in alternating blocks of ``--block`` runs.

Probes (the function replaced, module attribute): act_quant (o_proj's input quantization, triton_ops' call),
router, norm (``rms_norm_quant`` calls without ``out=``), qk_quant / v_quant (the FP8 attention's operand
quantization), gather (the MoE's ``gather_act_quant``), window (the sliding-window layers' attention), full (the
full layers' attention: its share beside the rest), rope (``rope_qk``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from gptoss_fp8.bench.prefill import prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.triton_ops import TritonOps

PROBES = {  # name: (module, attribute, which calls: a predicate on (args, kwargs))
    "act_quant": ("gptoss_fp8.kernels.act_quant", "act_quant", None),
    "router": ("gptoss_fp8.kernels.router", "router", None),
    "norm": ("gptoss_fp8.kernels.norm", "rms_norm_quant", lambda a, k: k.get("out") is None),
    "qk_quant": ("gptoss_fp8.kernels.attn_quant", "quantize_qk", None),
    "v_quant": ("gptoss_fp8.kernels.attn_quant", "quantize_v", None),
    "gather": ("gptoss_fp8.kernels.moe", "gather_act_quant", None),
    "window": ("gptoss_fp8.kernels.attention", "attention_prefill", lambda a, k: k.get("sliding_window", 0) > 0),
    "full": ("gptoss_fp8.kernels.attention", "attention_prefill", lambda a, k: k.get("sliding_window", 0) == 0),
    "rope": ("gptoss_fp8.kernels.rope", "rope_qk", None),
}


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple | list):
        return type(x)(_clone(v) for v in x)
    return x


class Replay:
    """Stands in for ``fn``: mode "record" runs it, times it (events) and keeps a clone of each output; "replay"
    returns the kept outputs in the same order without running it (calls the predicate rejects always run)."""

    def __init__(self, fn, pred):
        self.fn, self.pred = fn, pred
        self.mode, self.kept, self.i, self.events = "record", [], 0, []

    def __call__(self, *args, **kwargs):
        if self.pred is not None and not self.pred(args, kwargs):
            return self.fn(*args, **kwargs)
        if self.mode == "replay":
            out = self.kept[self.i]
            self.i += 1
            return out
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = self.fn(*args, **kwargs)
        e.record()
        self.events.append((s, e))
        self.kept.append(_clone(out))
        return out


def _timed(fn) -> float:
    torch.cuda.synchronize()
    s = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--attention", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--probes", default=",".join(PROBES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block", type=int, default=3, help="runs of one side before the other's")
    a = p.parse_args()
    cfg = preset_config(a.model)
    model = random_model(cfg, "cuda")
    ops = TritonOps(config=KernelConfig()).with_attention(a.attention)
    tokens = torch.randint(0, cfg.vocab_size, (a.tokens,), device="cuda")

    def fwd():
        return prefill_logits(model, tokens, ops)

    ref = fwd().clone()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 3.0:
        fwd()
    torch.cuda.synchronize()
    print(f"# {a.model} at {a.tokens} tokens, attention {a.attention}; blocks of {a.block}, {a.rounds} rounds")
    for name in a.probes.split(","):
        mod_name, attr, pred = PROBES[name]
        mod = importlib.import_module(mod_name)
        real = getattr(mod, attr)
        rep = Replay(real, pred)
        setattr(mod, attr, rep)
        try:
            out = fwd()
            torch.cuda.synchronize()
            own = sum(s.elapsed_time(e) for s, e in rep.events)
            calls = len(rep.kept)
            rep.mode = "replay"
            base, skip = [], []
            for _ in range(a.rounds):
                setattr(mod, attr, real)
                base += [_timed(fwd) for _ in range(a.block)]
                setattr(mod, attr, rep)
                for _ in range(a.block):
                    rep.i = 0
                    skip.append(_timed(fwd))
            rep.i = 0
            out = fwd()
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        finally:
            setattr(mod, attr, real)
        b, s = statistics.median(base), statistics.median(skip)
        print(f"{name:10s} {calls:3d} calls, own {own:7.2f} ms (events) | default {b * 1e3:8.2f} ms, without "
              f"{s * 1e3:8.2f} ms: saved {(b - s) * 1e3:6.2f} ms = {100 * (b - s) / (own / 1e3) if own else 0:5.1f}% "
              f"of its own | spread {1e3 * (max(base) - min(base)):.2f} / {1e3 * (max(skip) - min(skip)):.2f} ms | "
              f"logits rel {diff:.1e}", flush=True)
        del rep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

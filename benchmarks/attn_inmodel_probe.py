"""Why the FP8 full attention is slower inside the model than alone (issue 34): the 20b at 32768 tokens
spends ~16.4 ms a full layer on attention in ``bench prefill``'s breakdown, the kernel alone 14.3 ms
(benchmarks/attn_variants.py, random inputs). This times ``ws_attention_prefill_fp8`` (its Q / K / V
quantization, ``fp8_operands``, apart) in one process, five ways:

  model      inside the model's forward (every full layer's call, events around each)
  captured   alone on one full layer's own inputs captured in that forward, back to back
  randn      alone on attn_variants.py's inputs (q / k / v standard normal, sinks uniform in [-10, 10])
  heated     the captured inputs, each call after a bf16 GEMM of ~10 ms (the power cap and L2 as the MoE leaves
             them)
  model-sinks  the captured q / k / v with randn's sinks (does the softmax's data move the time?)

Usage (GPU machine): python3 benchmarks/attn_inmodel_probe.py [--model 20b] [--tokens 32768] [--reps 10]
[--attention fp8-lin] (the model's FP8 attention kind: fp8, the default, or fp8-lin, whose forms now trace too)
Prints one line a way: median ms a call (kernel, operands), min / max, and the SM clock / board power
where pynvml reads them. Then one traced call of model / captured / heated (``ws_attention_prefill_fp8(trace=)``,
benchmarks/attn_trace.py's analysis of head 0's longest programs): SM cycles a 128-key step. The same cycles a step
and a longer time say the clock (the power cap after the MoE); more cycles say the data or the memory.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import gptoss_fp8.kernels.attention_ws_fp8 as ws8
from gptoss_fp8.bench.prefill import prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.kernels.config import KernelConfig
from gptoss_fp8.model.triton_ops import TritonOps

_kernel, _operands = ws8.ws_attention_prefill_fp8, ws8.fp8_operands


class Timer:
    """Events around every ``ws_attention_prefill_fp8`` call and its ``fp8_operands`` while on."""

    def __init__(self):
        self.calls: list[tuple] = []  # (start, operands done, end)
        self.first: tuple | None = None
        self.on = False
        self._mark = None
        self.trace: torch.Tensor | None = None  # given to the next call (then cleared), untimed

    def operands(self, *a, **kw):
        r = _operands(*a, **kw)
        if self.on:
            self._mark = torch.cuda.Event(enable_timing=True)
            self._mark.record()
        return r

    def kernel(self, q, k, v, sinks, out, sm_scale, **kw):
        if self.first is None and q.shape[0] == k.shape[0]:
            self.first = (q.clone(), k.clone(), v.clone(), sinks.clone(), sm_scale,
                          {n: tuple(t.clone() for t in x) if isinstance(x, tuple) else x for n, x in kw.items()})
        if self.trace is not None and q.shape[0] == k.shape[0]:
            trace, self.trace = self.trace, None
            return _kernel(q, k, v, sinks, out, sm_scale, trace=trace, **kw)
        if not self.on:
            return _kernel(q, k, v, sinks, out, sm_scale, **kw)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        r = _kernel(q, k, v, sinks, out, sm_scale, **kw)
        e.record()
        self.calls.append((s, self._mark, e))
        return r

    def take(self) -> tuple[list[float], list[float]]:
        torch.cuda.synchronize()
        total = [s.elapsed_time(e) for s, _, e in self.calls]
        ops = [s.elapsed_time(m) for s, m, _ in self.calls]
        self.calls = []
        return [t - o for t, o in zip(total, ops, strict=True)], ops


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: (pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
    except Exception:  # noqa: BLE001 - the readings are extra
        return None


def report(name: str, kern: list[float], ops: list[float], reading) -> None:
    clock = f" | SM {reading[0]} MHz, {reading[1]:.0f} W (at the end)" if reading else ""
    print(f"{name:12s} kernel median {statistics.median(kern):.3f} ms (min {min(kern):.3f}, max {max(kern):.3f}, "
          f"{len(kern)} calls) | operands {statistics.median(ops):.3f} ms{clock}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--attention", default="fp8", choices=("fp8", "fp8-lin"))
    a = p.parse_args()
    timer = Timer()
    ws8.ws_attention_prefill_fp8, ws8.fp8_operands = timer.kernel, timer.operands
    read = _nvml()
    cfg = preset_config(a.model)
    model = random_model(cfg, "cuda")
    ops = TritonOps(config=KernelConfig()).with_attention(a.attention)
    tokens = torch.randint(0, cfg.vocab_size, (a.tokens,), device="cuda")
    prefill_logits(model, tokens, ops)  # compile; capture the first full layer's inputs
    assert timer.first is not None, "no full-attention call on the Gluon FP8 kernel in the forward"
    q, k, v, sinks, sm_scale, kw = timer.first
    out = torch.empty_like(q)
    g = torch.Generator(device="cuda").manual_seed(1234)
    T, hq, d = q.shape
    hkv = k.shape[1]
    fused = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
    rq, rk, rv = fused.split([hq * d, hkv * d, hkv * d], dim=1)
    rq, rk, rv = rq.view(T, hq, d), rk.view(T, hkv, d), rv.view(T, hkv, d)
    rsinks = torch.rand(hq, device="cuda", generator=g) * 20 - 10
    heat_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    heat_b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print(f"# {a.model} {a.tokens} tokens, --attention {a.attention}: q {tuple(q.shape)}, |q| mean {q.float().abs().mean():.3f}, "
          f"|k| mean {k.float().abs().mean():.3f}, sinks {sinks.float().min():.2f}..{sinks.float().max():.2f}, "
          f"kwargs {sorted(kw)}", flush=True)

    def alone(args, heat=False):
        for _ in range(a.reps):
            if heat:
                for _ in range(6):
                    torch.mm(heat_a, heat_b)
            ws8.ws_attention_prefill_fp8(*args, **kw)

    ways = {
        "model": lambda: prefill_logits(model, tokens, ops),
        "captured": lambda: alone((q, k, v, sinks, out, sm_scale)),
        "randn": lambda: alone((rq, rk, rv, rsinks.to(sinks.dtype), out, sm_scale)),
        "heated": lambda: alone((q, k, v, sinks, out, sm_scale), heat=True),
        "model-sinks": lambda: alone((q, k, v, rsinks.to(sinks.dtype), out, sm_scale)),
    }
    for n, fn in ways.items():  # warm (compiles the variants' launches)
        if n != "model":
            timer.on = False
            fn()
    results: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in ways}
    readings: dict = {}
    for _ in range(2):  # two rounds, ways interleaved
        for n, fn in ways.items():
            timer.on = True
            fn()
            torch.cuda.synchronize()
            readings[n] = read() if read else None
            kern, o = timer.take()
            results[n][0].extend(kern)
            results[n][1].extend(o)
            timer.on = False
    for n in ways:
        report(n, *results[n], readings[n])
    traced(timer, ways, T)


def traced(timer: Timer, ways: dict, T: int) -> None:
    """One traced call of the first full layer in the model, of the captured inputs alone and after the heating
    GEMM: attn_trace.py's step periods (SM cycles) of head 0's longest programs."""
    import numpy as np
    from attn_trace import analyse  # (benchmarks/, this script's directory)

    from gptoss_fp8.quant.fp8 import cdiv

    NWG, WG_ROWS = ws8.NWG, ws8.WG_ROWS  # noqa: N806 - the kernel's constants
    npm, steps = cdiv(T, NWG * WG_ROWS), cdiv(cdiv(T, 64), 2)
    n_steps = np.zeros((npm, NWG), dtype=np.int64)
    for p in range(npm):  # (attn_trace.main's count: program p holds rows (npm - 1 - p) * 192 ..)
        m0 = (npm - 1 - p) * NWG * WG_ROWS
        for w in range(NWG):
            r0 = m0 + w * WG_ROWS
            n_steps[p, w] = cdiv(min(r0 // 64 + 1, cdiv(min(m0 + NWG * WG_ROWS, T), 64)), 2) if r0 < T else 0
    sel = slice(0, min(48, npm))
    for n in ("model", "captured", "heated"):
        timer.trace = torch.zeros(npm, NWG, steps + 1, 8, dtype=torch.int32, device="cuda")
        trace = timer.trace
        ways[n]()
        torch.cuda.synchronize()
        res = analyse(trace.cpu().numpy().view(np.uint32)[sel], n_steps[sel])
        periods = {w: r["period_median"] for w, r in res["per_warpgroup"].items()}
        print(f"{n:12s} traced: step period median (SM cycles) by warpgroup {periods}", flush=True)


if __name__ == "__main__":
    main()

"""A/B: o_proj then the residual add + RMSNorm + FP8 quantization as two launches (``fp8_gemm_skinny``
+ ``norm.rms_norm_quant``, what decode runs today) against one (``fp8_gemm_skinny_add_rms_norm``,
the norm fused into the GEMM's epilogue; kernels/fp8_gemv.py). An experiment, not wired in.

The 20b o_proj (N 2880, K 4096, bf16 bias) at M = 1 / 4 / 8 rows: a chain of LAYERS layers, each
with its own weight (24 x 11.8 MB: read from HBM, as in a decode step) and norm weight, the
residual threaded through (layer i + 1 adds to layer i's xo), captured as one CUDA graph per
variant, with and without PDL:
  unfused-w4   skinny_tile's launch (4 warps) + rms_norm_quant            (today's decode)
  unfused-w8   the same GEMM at 8 warps + rms_norm_quant                  (the fused default's GEMM)
  fused-w8     the default: skinny_tile's split at norm.py's 8 warps (the norm's reduction order)
  fused-w4     skinny_tile's launch as is (4 warps; the norm's sums in another order)
Replays are interleaved over the variants (rep by rep), medians of ``--reps`` event-timed replays
divided by LAYERS: us per layer. Each variant's last-layer outputs (delta, xo, y, q, s) are then
compared bit for bit with its unfused twin's (fused-w8 with unfused-w8, fused-w4 with unfused-w4):
``identical`` or the count of differing elements per output.

On the GPU machine, from the repository root:

    PYTHONPATH=$(pwd) python3 benchmarks/gemv_norm_ab.py
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels.fp8_gemv import fp8_gemm_skinny, fp8_gemm_skinny_add_rms_norm, skinny_tile
from gptoss_fp8.kernels.norm import rms_norm_quant
from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

N, K, EPS = 2880, 4096, 1e-5
VARIANTS = ("unfused-w4", "unfused-w8", "fused-w8", "fused-w4")
TWIN = {"fused-w8": "unfused-w8", "fused-w4": "unfused-w4"}


def make_layers(m: int, layers: int, g: torch.Generator) -> list[tuple]:
    out = []
    for _ in range(layers):
        x_fp8, x_scale = quantize_act(torch.randn(m, K, device="cuda", generator=g))
        w_fp8, w_scale = quantize_weight_blocks(torch.randn(N, K, device="cuda", generator=g) * 0.05)
        bias = (torch.randn(N, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        nw = torch.rand(N, device="cuda", generator=g) + 0.5
        out.append((x_fp8, x_scale, w_fp8, w_scale, bias, nw))
    return out


def chain(variant: str, layers: list[tuple], resid: torch.Tensor, deltas: list[torch.Tensor], pdl: bool):
    """One pass over the layers; returns the last layer's (delta, xo, y, q, s)."""
    m = resid.shape[0]
    warps = 8 if variant.endswith("w8") else 4
    tile = replace(skinny_tile(m, N, K, sm_count(resid.device)), num_warps=warps)
    out = None
    for (x_fp8, x_scale, w_fp8, w_scale, bias, nw), delta in zip(layers, deltas, strict=True):
        if variant.startswith("fused"):
            out = fp8_gemm_skinny_add_rms_norm(x_fp8, x_scale, w_fp8, w_scale, bias, resid, nw, EPS, tile=tile, pdl=pdl)
        else:
            fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, bias, delta, tile=tile, pdl=pdl)
            xo, y, (q, s) = rms_norm_quant(resid, delta, nw, EPS, pdl=pdl)
            out = (delta, xo, y, q, s)
        resid = out[1]
    return out


def capture(fn):
    """(graph, outputs): warm-up (compiles) on a side stream, then the capture (as bench's _ms_graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def compare(a, b) -> str:
    diffs = []
    for name, x, y in zip(("delta", "xo", "y", "q", "s"), a, b, strict=True):
        x, y = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (x, y))
        if not torch.equal(x, y):
            diffs.append(f"{name}: {int((x != y).sum())} of {x.numel()} differ")
    return "identical" if not diffs else "; ".join(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    assert torch.cuda.is_available(), "the benchmark runs on the GPU machine"
    for m in a.rows:
        g = torch.Generator(device="cuda").manual_seed(m)
        layers = make_layers(m, a.layers, g)
        resid = (torch.randn(m, N, device="cuda", generator=g) * 2).to(torch.bfloat16)
        for pdl in (False, True):
            graphs, outs, times = {}, {}, {v: [] for v in VARIANTS}
            for v in VARIANTS:
                deltas = [torch.empty(m, N, dtype=torch.bfloat16, device="cuda") for _ in layers]
                graphs[v], outs[v] = capture(lambda v=v, deltas=deltas: chain(v, layers, resid, deltas, pdl))
            for _ in range(a.reps):  # interleaved: every variant sees the same clocks and neighbours
                for v in VARIANTS:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs[v].replay()
                    end.record()
                    end.synchronize()
                    times[v].append(start.elapsed_time(end) * 1e3 / a.layers)
            base = statistics.median(times["unfused-w4"])
            print(f"M={m} pdl={'on' if pdl else 'off'} ({a.layers} layers, {a.reps} replays each):", flush=True)
            for v in VARIANTS:
                us = statistics.median(times[v])
                same = f", vs {TWIN[v]}: {compare(outs[v], outs[TWIN[v]])}" if v in TWIN else ""
                print(f"  {v:>10}: {us:6.2f} us per layer ({us - base:+5.2f} vs unfused-w4){same}", flush=True)
            del graphs, outs
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()

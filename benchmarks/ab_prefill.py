"""Whole-model prefill A/B in one process: the same random model and tokens, variants of the
forward, runs interleaved (A, B, A, B, ...) so clock drift and machine-to-machine spread hit all
alike.

Usage (GPU machine): python3 benchmarks/ab_prefill.py --model 20b --tokens 8192 --runs 10 \\
    [--variants default,graph,unfused-combine,torch-router]
Variants: "default" (the ``triton`` ops backend as shipped), "unfused-combine" (the MoE's weighted
combine as its own kernel before the residual-add + norm, as before 2026-11-29 fifth session),
"graph" (the forward captured as a CUDA graph, bench/prefill.GraphedPrefill), "torch-router" (the
router as torch's bf16 linear + topk + softmax instead of kernels/router.py), "triton-gemm" (the
dense GEMMs on the Triton kernel at every size, i.e. without the Gluon warp-specialized kernel that
fp8_gemm picks from WS_MIN_ROWS rows on, seventh session), "triton-moe" (the expert GEMMs on the
Triton kernels, i.e. without kernels/moe_ws.py), "triton-all" (both), "ws-down" (the Gluon down
GEMM too, moe.WS_MOE_DOWN), "gather-quant" / "gather-requant" (gate_up's sorted A copied from the norm's FP8 rows, or
quantized again from its bf16 rows: moe.GATHER_FROM_QUANT on / off; on by default since the ninth
session), "gu-s<stages>-g<GROUP_M>", e.g. "gu-s5-g16" (the Gluon gate_up's ring depth and tile-order
group instead of 4 stages, GROUP_M 8; tenth session).
(Programmatic dependent launch of our kernels was measured here too, fifth session: no gain at 8192,
0.4-0.6% slower at 32768; removed, see benchmarks/notes/prefill.md.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_fp8.bench.prefill import GraphedPrefill, prefill_logits, random_model
from gptoss_fp8.config import preset_config
from gptoss_fp8.model.ops import ReferenceOps, W8A8CpuOps
from gptoss_fp8.model.triton_ops import TritonOps


class UnfusedCombine(TritonOps):
    """The combine kernel, then the add + norm kernel (the spec's composition on our kernels)."""

    moe_combine_add_rms_norm = ReferenceOps.moe_combine_add_rms_norm


class TorchRouter(TritonOps):
    """The router in torch (the spec's ``route`` on the GPU), everything else as shipped."""

    route = W8A8CpuOps.route


def _switched(fn, dense_ws: bool = True, moe_ws: bool = True, moe_ws_down: bool = False,
              gather_from_quant: bool | None = None, gu_stages: int | None = None, gu_group: int | None = None):
    """fn with the Gluon warp-specialized dense GEMM and / or expert GEMMs switched off (or the down
    one on), or moe.GATHER_FROM_QUANT / the Gluon gate_up's stages and GROUP_M set, for the call."""
    from gptoss_fp8.kernels import fp8_gemm, moe

    def run(t):
        old = (fp8_gemm.WS_MIN_ROWS, moe.WS_MOE, moe.WS_MOE_DOWN, moe.GATHER_FROM_QUANT, moe.WS_GATE_UP_STAGES,
               moe.WS_GATE_UP_GROUP_M)
        fp8_gemm.WS_MIN_ROWS = old[0] if dense_ws else 1 << 62
        moe.WS_MOE = old[1] and moe_ws
        moe.WS_MOE_DOWN = moe_ws_down
        moe.GATHER_FROM_QUANT = old[3] if gather_from_quant is None else gather_from_quant
        moe.WS_GATE_UP_STAGES = old[4] if gu_stages is None else gu_stages
        moe.WS_GATE_UP_GROUP_M = old[5] if gu_group is None else gu_group
        try:
            return fn(t)
        finally:
            (fp8_gemm.WS_MIN_ROWS, moe.WS_MOE, moe.WS_MOE_DOWN, moe.GATHER_FROM_QUANT, moe.WS_GATE_UP_STAGES,
             moe.WS_GATE_UP_GROUP_M) = old

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="20b")
    p.add_argument("--tokens", default="8192")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--variants", default="default,graph")
    a = p.parse_args()
    cfg = preset_config(a.model)
    model = random_model(cfg, "cuda")
    for n in [int(t) for t in a.tokens.split(",")]:
        ops = TritonOps()
        make = {
            "default": lambda: (lambda t: prefill_logits(model, t, ops)),
            "unfused-combine": lambda: (lambda t, o=UnfusedCombine(): prefill_logits(model, t, o)),
            "torch-router": lambda: (lambda t, o=TorchRouter(): prefill_logits(model, t, o)),
            "triton-gemm": lambda: _switched(lambda t: prefill_logits(model, t, ops), dense_ws=False),
            "triton-moe": lambda: _switched(lambda t: prefill_logits(model, t, ops), moe_ws=False),
            "triton-all": lambda: _switched(lambda t: prefill_logits(model, t, ops), dense_ws=False, moe_ws=False),
            "ws-down": lambda: _switched(lambda t: prefill_logits(model, t, ops), moe_ws_down=True),
            "gather-quant": lambda: _switched(lambda t: prefill_logits(model, t, ops), gather_from_quant=True),
            "gather-requant": lambda: _switched(lambda t: prefill_logits(model, t, ops), gather_from_quant=False),
            "graph": lambda: GraphedPrefill(model, n, ops),
        }
        tokens = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
        prefill_logits(model, tokens, ops)  # compile before any capture
        for name in a.variants.split(","):
            if name.startswith("gu-s"):  # gu-s<stages>-g<GROUP_M>: the Gluon gate_up's ring depth and tile order
                st, gr = (int(v) for v in name[4:].split("-g"))
                make[name] = lambda st=st, gr=gr: _switched(lambda t: prefill_logits(model, t, ops), gu_stages=st, gu_group=gr)
        variants = {name: make[name]() for name in a.variants.split(",")}
        ref = None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0:  # warm-up: compile all, let clocks settle
            for fn in variants.values():
                out = fn(tokens)
                ref = out.clone() if ref is None else ref
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.runs):
            for name, fn in variants.items():
                torch.cuda.synchronize()
                s = time.perf_counter()
                fn(tokens)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - s)
        for name, ts in times.items():
            out = variants[name](tokens)
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{a.model} {n} tokens | {name}: median {statistics.median(ts):.4f} s, "
                  f"min {min(ts):.4f}, max {max(ts):.4f} | logits vs first rel {diff:.2e}", flush=True)
        del variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""A later prompt chunk's attention (``q_offset``: the serving engine's chunks after the first) on the Triton
kernel against the Gluon kernels (``KernelConfig.attention_gluon_offset`` / ``attention_gluon_fp8_offset``, built
without a GPU in the twenty-ninth session), bf16 and FP8, side by side in one process (issue 34).

Run on the GPU machine from the repository root:
    PYTHONPATH=$PWD python3 benchmarks/attn_offset.py [--chunks 8192@0,8192@32768,8192@119808] [--passes 2] \
        [--fp8-tiles 128x64x8x3r128,128x64x8x3,128x64x8x4,128x32x4x3]
``--fp8-tiles`` (thirty-second session): FP8 rows of the Triton kernel on each tile BMxBNxWARPSxSTAGES[rMAXNREG]
too (``attention_prefill(tile=)``): the causal tile it shares with bf16, 128x64x8x3r128, spills 236 bytes since
its row sum moved to the tensor core (sm_90 compile), 128x64x8x3 / x4 (no cap: 250 registers, no spills) and
128x32x4x3 do not.
Each case T@P: q of T rows at key positions P.. of P + T keys (64 query / 8 KV heads, head_dim 64, fresh
random inputs, sinks -10..10). Per case and numerics: each path's relative error against fp32 attention
(``spec.attention(q_offset=)`` on sampled rows; FP8's includes its operands' rounding) and the two paths'
difference (the GPU tests hold each against its spec), then ms of each pass (interleaved) and pairs/s (the
chunk's visible pairs x 64 heads / s).
"""

from __future__ import annotations

import argparse

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention import attention_prefill
from gptoss_fp8.kernels.config import KernelConfig, PrefillTile

HQ, HKV, D = 64, 8, 64


def _sampled_rel(out: torch.Tensor, q, k, v, sinks, q_offset: int) -> float:
    """Relative error of out's first / middle / last 64 rows against spec.attention in fp32 (the whole spec of a
    long chunk does not fit; causal rows are independent, so each sample runs on the keys its rows see)."""
    T = q.shape[0]
    errs = []
    for r0 in sorted({0, max(0, T // 2 - 32), max(0, T - 64)}):
        r1 = min(T, r0 + 64)
        kk, vv = k[:q_offset + r1], v[:q_offset + r1]
        ref = spec.attention(q[r0:r1].float(), kk.float(), vv.float(), sinks, None, 0, q_offset + r0,
                             dtype=torch.float32).float()
        o = out[r0:r1].float()
        errs.append(((o - ref).norm() / ref.norm()).item())
    return max(errs)


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser()
    p.add_argument("--chunks", default="8192@0,8192@32768,8192@119808")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--fp8-tiles", default="", help="Triton FP8 tiles BMxBNxWARPSxSTAGES[rMAXNREG], comma-separated")
    a = p.parse_args()
    tiles = {}
    for t in filter(None, a.fp8_tiles.split(",")):
        dims, _, cap = t.partition("r")
        bm, bn, w, st = (int(x) for x in dims.split("x"))
        tiles[f"triton-{t}"] = PrefillTile(bm, bn, w, st, maxnreg=int(cap) if cap else None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sinks = torch.linspace(-10, 10, HQ, device="cuda")
    configs = {"triton": KernelConfig(),
               "gluon": KernelConfig(attention_gluon_offset=True, attention_gluon_fp8_offset=True)}
    rows = []
    for case in a.chunks.split(","):
        T, P = (int(x) for x in case.split("@"))
        q = torch.randn(T, HQ, D, generator=gen, device="cuda").bfloat16()
        k, v = (torch.randn(P + T, HKV, D, generator=gen, device="cuda").bfloat16() for _ in range(2))
        pairs = (T * P + T * (T + 1) / 2) * HQ
        for fp8 in (False, True):
            runs = {n: (lambda c=c: attention_prefill(q, k, v, sinks, fp8=fp8, q_offset=P, config=c))
                    for n, c in configs.items()}
            if fp8:
                runs.update({n: (lambda t=t: attention_prefill(q, k, v, sinks, fp8=True, q_offset=P, tile=t))
                             for n, t in tiles.items()})
            outs = {n: f() for n, f in runs.items()}
            for n, o in outs.items():  # (FP8: against fp32 attention, the error of the e4m3 operands included)
                print(f"{T}@{P} {'fp8' if fp8 else 'bf16'} {n}: rel. error vs fp32 attention "
                      f"{_sampled_rel(o, q, k, v, sinks, P):.2e}", flush=True)
            g, t = outs["gluon"].float(), outs["triton"].float()
            print(f"{T}@{P} {'fp8' if fp8 else 'bf16'}: gluon vs triton rel {((g - t).norm() / t.norm()).item():.2e}",
                  flush=True)
            del outs, g, t
            ms = {n: [] for n in runs}
            for _ in range(a.passes):
                for n, f in runs.items():
                    ms[n].append(do_bench(f, warmup=50, rep=300))
            for n in runs:
                best = min(ms[n])
                rows.append((f"{T}@{P}", "fp8" if fp8 else "bf16", n, ms[n], pairs / (best * 1e-3)))
                print(f"{T}@{P} {'fp8' if fp8 else 'bf16'} {n}: " + " / ".join(f"{m:.3f}" for m in ms[n])
                      + f" ms, {pairs / (best * 1e-3):.3e} pairs/s", flush=True)
    print("\n| chunk | numerics | kernel | ms (passes) | pairs/s |\n| --- | --- | --- | --- | --- |")
    for c, num, n, m, pps in rows:
        print(f"| {c} | {num} | {n} | {' / '.join(f'{x:.3f}' for x in m)} | {pps:.3e} |")


if __name__ == "__main__":
    main()

"""The noise of the run at hand: how far FP8 activations alone move each part, on these inputs.

A fixed table of limits, calibrated on random checkpoints, is ~3x too loose on a trained model
(random routers make FP8 noise ~0.06 of a part's output, trained ones ~0.01-0.03) and too tight on
shapes it never saw. So the FP8 modes' part limits follow this run's own noise (docs/verify.md).

Activation grids. ``quantize_act`` maps each 128-group's amax to ``fp8_max``; any e4m3 value near
the top of the range is as good a choice as 448 (``GRIDS``: 448, 416, 384, 352, 320, 288, each
exactly representable, so the group's largest element, often an outlier that dominates the norm
of a trained model's activations, stays exact on every grid). Every other element lands elsewhere
in its binade on each grid: the rounding errors of different grids are independent draws of the
same noise. (A grid whose fp8_max is not representable, 448 x 0.8 say, rounds the outlier too and
overstates the noise 2-5x on a trained model: measured.)

* The w8a8 mode runs its parts on all K = len(GRIDS) grids, through the same ops (and ops hook)
  as the mode itself, and the verdict compares their MEAN with the target: its FP8 noise is
  1/sqrt(K) of one grid's, a bug (in every grid's run alike) stays whole. ``grid_noise``: the
  mean, and one grid's noise from the spread of the K runs around it (a bug does not widen it).
* The kernels compute on the 448 grid only: their limit follows one grid's noise, measured on the
  clean spec (no ops hook) on two other grids (``dither_parts``: ||a - b|| / sqrt(2)).
* ``store_floor``: one bf16 ulp of the block's output (the residual stream after the add), RMS
  over [T, H], relative to what the block adds: a store that truncates where the reference rounds
  (Triton's interpreter) moves an element by up to one ulp; on a model whose block adds 5% of the
  stream's norm that is ~0.04 by itself, and the GPU does not have it.

All are relative to what the target's block adds (the norm of ``parts.part_rel_err``);
``thresholds.NoiseRule`` turns them into a limit.
"""

from __future__ import annotations

import math

import torch

from gptoss_fp8.model.ops import ReferenceOps, W8A8CpuOps
from gptoss_fp8.quant.fp8 import FP8_MAX
from gptoss_fp8.verify.parts import PARTS, part_input, run_parts

GRIDS = (FP8_MAX, 416.0, 384.0, 352.0, 320.0, 288.0)
DITHER_MAX = (416.0, 384.0)


def grid_ops(prepared=None, attention: str = "bf16") -> list[W8A8CpuOps]:
    """The w8a8 spec on every grid but the first (448, the mode's own); ``prepared``: the
    dequantized weights to share (model/ops.py PreparedWeights). ``attention`` "fp8": the FP8
    attention's Q / K / V are rounded on the same grid (``spec.attention_fp8``'s fp8_max), so its
    noise is redrawn too."""
    return [W8A8CpuOps(act_max=m, prepared=prepared).with_attention(attention) for m in GRIDS[1:]]


def dither_parts(model, tokens: torch.Tensor, target: dict[str, torch.Tensor],
                 attention: str = "bf16") -> tuple[dict, dict]:
    """The clean w8a8 spec's parts on the target's inputs on two other activation grids (and
    attention grids, with ``attention`` "fp8")."""
    first = W8A8CpuOps(act_max=DITHER_MAX[0]).with_attention(attention)
    ops = [first, W8A8CpuOps(act_max=DITHER_MAX[1], prepared=first.prepared).with_attention(attention)]
    return tuple(run_parts(model, tokens, o, target) for o in ops)


def attention_dither_parts(model, tokens: torch.Tensor, target: dict[str, torch.Tensor],
                           prepared=None, attention: str = "fp8") -> tuple[dict, dict]:
    """``--attention fp8``, the weights mode: its parts on the target's inputs with the FP8
    attention's Q / K / V on two other grids (DITHER_MAX; activations stay bf16): the noise of the
    FP8 attention alone, which the ``attention-fp8`` rule's limits follow. ``attention``: the FP8 kind ("fp8" or
    "fp8-lin", whose P codes move with P's scale on each grid)."""
    ops = []
    for m in DITHER_MAX:
        o = ReferenceOps().with_attention(attention)
        o.attention_fp8_max = m
        if prepared is not None:
            o.prepared = prepared
        ops.append(o)
    return tuple(run_parts(model, tokens, o, target) for o in ops)


def grid_noise(runs: list[dict[str, torch.Tensor]], target: dict[str, torch.Tensor],
               n_layers: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The K grids' parts (``runs``: the mode's own first) -> (their mean per "{i}.attn" / "{i}.mlp"
    (float64, plus "0.in"), one grid's noise per part relative to what the target's block adds:
    sqrt(sum_k ||run_k - mean||^2 / (K - 1)))."""
    mean: dict[str, torch.Tensor] = {"0.in": runs[0]["0.in"]}
    noise: dict[str, float] = {}
    for i in range(n_layers):
        for part in PARTS:
            key = f"{i}.{part}"
            if key not in target or any(key not in r for r in runs):
                continue
            stack = torch.stack([r[key].double() for r in runs])  # [K, T, H]
            m = stack.mean(0)
            mean[key] = m
            spread = ((stack - m) ** 2).sum().div(len(runs) - 1).sqrt()
            noise[key] = _rel(spread, part_input(target, key, runs[0]["0.in"]), target[key])
    return mean, noise


def _rel(num: torch.Tensor, x_in: torch.Tensor, t_out: torch.Tensor) -> float:
    return float(num / (t_out.double() - x_in.double()).norm().clamp(min=1e-30))


def part_noise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
               n_layers: int) -> dict[str, float]:
    """"{i}.attn" / "{i}.mlp" -> the FP8 rounding noise of that part relative to what the target's
    block adds (||a - b|| / sqrt(2) / ||target - input||)."""
    out = {}
    for i in range(n_layers):
        for part in PARTS:
            key = f"{i}.{part}"
            if key in a and key in b and key in target:
                d = (a[key].double() - b[key].double()).norm() / math.sqrt(2)
                out[key] = _rel(d, part_input(target, key, a["0.in"]), target[key])
    return out


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp of each element (float64): 2^(e - 8) for |t| = m 2^e, m in [0.5, 1)."""
    _, e = torch.frexp(t.double())
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 8)


def store_floor(x_in: torch.Tensor, t_out: torch.Tensor) -> float:
    """RMS-summed bf16 ulp of the block's output over [T, H], relative to what the block adds."""
    return _rel(bf16_ulp(t_out).norm(), x_in, t_out)


def store_floors(target: dict[str, torch.Tensor], embedded: torch.Tensor, n_layers: int) -> dict[str, float]:
    return {f"{i}.{p}": store_floor(part_input(target, f"{i}.{p}", embedded), target[f"{i}.{p}"])
            for i in range(n_layers) for p in PARTS if f"{i}.{p}" in target}

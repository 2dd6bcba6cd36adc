"""The noise of the run at hand: how far FP8 activations alone move each part, on these inputs.

A fixed table of limits, calibrated on random checkpoints, is ~3x too loose on a trained model
(random routers make FP8 noise ~0.06 of a part's output, trained ones ~0.01-0.03) and too tight on
shapes it never saw. So the FP8 modes' part limits follow this run's own noise (docs/verify.md):

* ``dither_parts``: the w8a8 spec's parts (verify/parts.py ``run_parts``, on the target's inputs)
  twice more, with the activations quantized on two other grids (``quantize_act``'s fp8_max =
  448 x 0.8 and 448 x 0.9: each group's amax lands elsewhere in the e4m3 range, so every element
  rounds independently, with the same relative error statistics). Their difference is pure FP8
  rounding noise, sqrt(2) x one draw's; a bug in the code under test cancels from it (both runs
  share it), so a bug can never widen its own limit. The spec is used, never the backend under
  test, and no ops hook reaches it.
* ``part_noise``: ||a - b|| / sqrt(2) relative to what the target's block adds (the same norm as
  the error, ``parts.part_rel_err``).
* ``store_floor``: one bf16 ulp of the block's output (the residual stream after the add), RMS
  over [T, H], relative to what the block adds: a store that truncates where the reference rounds
  (Triton's interpreter) moves an element by up to one ulp; on a model whose block adds 5% of the
  stream's norm that is ~0.04 by itself, and the GPU does not have it.

``thresholds.noise_limit`` turns these into a limit: k x noise + store x floor + a small floor.
"""

from __future__ import annotations

import math

import torch

from gptoss_fp8.model.ops import W8A8CpuOps
from gptoss_fp8.quant.fp8 import FP8_MAX
from gptoss_fp8.verify.parts import PARTS, part_input, run_parts

DITHER_MAX = (FP8_MAX * 0.8, FP8_MAX * 0.9)


def dither_parts(model, tokens: torch.Tensor, target: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The w8a8 spec's parts on the target's inputs on two other activation grids (module docstring)."""
    return tuple(run_parts(model, tokens, W8A8CpuOps(act_max=m), target) for m in DITHER_MAX)


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

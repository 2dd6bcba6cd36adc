"""The 16-bit codes' bounds of ``--attention fp8-lin`` on a real checkpoint's scores (no GPU needed; issue 34).

Runs the checkpoint's forward on the reference ops (CPU), captures each full-attention layer's rotated Q, K and V,
quantizes them as the FP8 kernel's launcher does (``attention_ws_fp8.fp8_operands``: Q / K blocks' scales and row
norms) and prints, per layer, the largest real |score| of a Q tile and within-row spread (log2 units) beside the two
bounds the kernel's forms use: exp_lin 2 / 4's amax bound D 448^2 c (every step past the 16-bit limit takes the exact
path) and exp_lin 5's ``lin_bounds`` (the default since the forty-sixth session); and how many of the Q tiles keep
the fast path under each (bound + max(sink, bound + 1) <= 4000 and bound - sink <= 4000).

    python benchmarks/lin_bound_probe.py CHECKPOINT [--tokens N]

CHECKPOINT: a converted checkpoint (``gptoss-fp8 convert golden/trained /tmp/x``); the tokens are verify-logits'
built-in sample (``--tokens N``: its first N).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from gptoss_fp8.kernels.attention_ws_fp8 import fp8_operands, lin_bounds
from gptoss_fp8.model.load import load_model
from gptoss_fp8.model.ops import ReferenceOps
from gptoss_fp8.spec import LOG2E
from gptoss_fp8.verify.samples import default_tokens


class Capturing(ReferenceOps):
    """ReferenceOps keeping each full-attention call's rotated q, k, v (fp32), sinks (log2 units) and sm_scale."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _attend(self, q, k, v, sinks, sm_scale, window, q_offset):
        if not window:
            n, kvh, m, d = q.shape
            self.calls.append((q.reshape(n, kvh * m, d).float(), k.float(), v.float(),
                               sinks.reshape(-1).float() * LOG2E, sm_scale))
        return super()._attend(q, k, v, sinks, sm_scale, window, q_offset)


def bounds(q, k, v, sm_scale):
    """One captured call -> (each Q tile's largest causal |score| [Hq, nbq], the largest within-row spread, the amax
    bound D 448^2 c [Hq, nbq] of exp_lin 2 / 4, exp_lin 5's ``lin_bounds`` [Hq, nbq]), log2 units, the spec's
    operands (``fp8_operands`` on the CPU)."""
    hq, hkv, t = q.shape[1], k.shape[1], q.shape[0]
    q8, sq, k8, sk, _, _, kn, qn = fp8_operands(q, k, v, sm_scale, k_norms=True, q_norms=True)
    g = hq // hkv
    x = torch.einsum("qhd,khd->hqk", q8.float(), k8.float().repeat_interleave(g, 1))
    x = x * sq.repeat_interleave(64, 1)[:, :t, None] * sk.repeat_interleave(64, 1)[:, None, :t].repeat_interleave(g, 0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    nbq = math.ceil(t / 64)
    tile = torch.nn.functional.pad(x.abs().masked_fill(~causal, 0).amax(2), (0, nbq * 64 - t)).view(hq, nbq, 64).amax(2)
    spread = (x.masked_fill(~causal, -1e30).amax(2) - x.masked_fill(~causal, 1e30).amin(2)).amax().item()
    amax_b = sq * sk.amax(1).repeat_interleave(g)[:, None] * 64 * 448.0 ** 2
    return tile, spread, amax_b, lin_bounds(sq, qn, sk, kn)


def fast_ok(bound: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The kernel's condition for its 16-bit codes (``_fp8_pairs``), bound [Hq, nbq] and sink [Hq] in log2 units."""
    s = sink[:, None]
    return (bound + torch.maximum(s, bound + 1) <= 4000) & (bound - s <= 4000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--tokens", type=int, default=0, help="the sample's first N tokens (0: all)")
    a = ap.parse_args()
    model = load_model(str(a.checkpoint))
    ids, where = default_tokens(a.checkpoint, model.cfg.vocab_size)
    ids = ids[:a.tokens] if a.tokens else ids
    ops = Capturing()
    with torch.inference_mode():
        model.forward(torch.tensor(ids), ops)
    print(f"# {a.checkpoint}: {len(ids)} tokens ({where}), {len(ops.calls)} full-attention calls")
    print("| layer call | real max |x| a tile | max spread in a row | amax bound (min-max) | fast tiles | "
          "norm bound (min-max) | fast tiles |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, (q, k, v, sink, sm_scale) in enumerate(ops.calls):
        tile, spread, amax_b, norm_b = bounds(q, k, v, sm_scale)
        if (tile > norm_b).any():
            sys.exit(f"layer call {i}: a score above its tile's norm bound (a bug in lin_bounds)")
        print(f"| {i} | {tile.amax().item():.0f} | {spread:.0f} | {amax_b.amin().item():.0f}-{amax_b.amax().item():.0f} | "
              f"{fast_ok(amax_b, sink).float().mean().item():.0%} | {norm_b.amin().item():.0f}-{norm_b.amax().item():.0f} | "
              f"{fast_ok(norm_b, sink).float().mean().item():.0%} |")


if __name__ == "__main__":
    main()

"""The quantizing kernels at the 20b's prefill shapes, timed (issue 34, thirty-third session): act_quant (o_proj's
input), the norm with its FP8 rows (after the attention; fused with the MoE's combine after the MoE), the FP8
attention's operands (q with its rope, k, v). Run twice on the GPU, the second time with GPTOSS_FP8_E4M3=soft (the
rounding the kernels used before: round_to_e4m3's integer arithmetic before the cast, kernels/act_quant.py): the
hardware cast's time against it, and a digest of every output's values (-0 taken as +0) that must be the same in
both runs.

    PYTHONPATH=$(pwd) python3 benchmarks/quant_ab.py [--tokens 32768,128000]
    PYTHONPATH=$(pwd) GPTOSS_FP8_E4M3=soft python3 benchmarks/quant_ab.py [--tokens 32768,128000]
    TRITON_INTERPRET=1 python3 benchmarks/quant_ab.py --device cpu --tokens 130   # CPU smoke run, no timing

Prints one line a kernel and length: ms (median of triton's do_bench), the bytes it moves a second, the digest.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import triton

from gptoss_fp8 import spec
from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.attention_ws_fp8 import key_order
from gptoss_fp8.kernels.attn_quant import quantize_qk, quantize_v
from gptoss_fp8.kernels.norm import rms_norm_quant

H, HQ, HKV, D, TOP_K = 2880, 64, 8, 64, 4


def digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        v = t.float() + 0.0  # (-0 + 0 = +0: the soft rounding's zeros are +0, the hardware's keep the sign)
        h.update(v.contiguous().view(torch.int32).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="32768,128000")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run through Triton's interpreter (TRITON_INTERPRET=1), "
                    "no timing")
    args = ap.parse_args()
    dev = args.device
    mode = "interp" if dev == "cpu" else os.environ.get("GPTOSS_FP8_E4M3", "") or "hardware"
    g = torch.Generator(device=dev).manual_seed(33)
    for t in (int(s) for s in args.tokens.split(",")):
        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

        o, x, delta, slots = rnd(t, HQ * D), rnd(t, H, scale=4.0), rnd(t, H), rnd(t, TOP_K, H)
        weights = torch.softmax(torch.randn(t, TOP_K, device=dev, generator=g), -1).bfloat16()
        nw = torch.rand(H, device=dev, generator=g) + 0.5
        q, k, v = rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, D)
        cos, sin = spec.rope_table(t, D, device=dev)
        order = key_order(dev)
        cases = {
            "act_quant o": (lambda: act_quant(o), (o,)),
            "norm + quant (attn)": (lambda: rms_norm_quant(x, delta, nw, 1e-5), (x, delta)),
            "combine + norm + quant (moe)": (lambda: rms_norm_quant(x, slots, nw, 1e-5, combine=weights), (x, slots)),
            "quantize_qk q + rope": (lambda: quantize_qk(q, rope=(cos, sin)), (q,)),
            "quantize_qk k": (lambda: quantize_qk(k), (k,)),
            "quantize_v v": (lambda: quantize_v(v, key_order=order, pad_to=64), (v,)),
        }
        for name, (fn, inputs) in cases.items():
            out = fn()
            flat = [u for u in (out if isinstance(out, tuple) else (out,)) for u in (u if isinstance(u, tuple) else (u,))]
            ms = triton.testing.do_bench(fn, warmup=25, rep=200) if dev == "cuda" else float("nan")
            moved = nbytes(*inputs, *[u for u in flat if u is not None])
            print(f"{mode:8s} T={t} {name:30s} | {ms:8.4f} ms {moved / ms / 1e9:7.2f} TB/s | digest {digest(*flat)}",
                  flush=True)


if __name__ == "__main__":
    main()

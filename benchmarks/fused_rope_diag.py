"""The FP8 attention's q rotated inside its quantization (attn_quant.py ROPE) against q rotated first by
kernels/rope.py: which bytes / outputs differ and by how much (test_prefill_fp8_fused_q_rope[lens3] failed its
bit-equality on the H200 in the thirty-first session: one sequence of 4099 rows, 64 heads).
GPU: PYTHONPATH=. python3 benchmarks/fused_rope_diag.py; CPU: TRITON_INTERPRET=1 HQ=4 LENS="([70],)" (same)."""

import os
import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_attention import DEV, D, _cu, _qkv, _sinks  # noqa: E402

from gptoss_fp8 import spec  # noqa: E402
from gptoss_fp8.kernels.attention import attention_prefill  # noqa: E402
from gptoss_fp8.kernels.attn_quant import quantize_qk  # noqa: E402
from gptoss_fp8.kernels.rope import rope_qk  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


H = int(os.environ.get("HQ", 64))
for lens in eval(os.environ.get("LENS", "([4099], [1000, 3000], [2000], [130], [32768])")):
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v = _qkv(sum(lens), H, max(1, H // 8), gen)
    sinks = _sinks(H, gen)
    cu = _cu(lens) if len(lens) > 1 else None
    cos, sin = spec.rope_table(max(lens), D, device=DEV)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEV, torch.int32)
    q_r = rope_qk(None, q, pos, cos, sin)[1]
    if cu is None:
        a8, asc = quantize_qk(q_r)
        b8, bsc = quantize_qk(q, rope=(cos, sin))
        flips = (a8.view(torch.uint8) != b8.view(torch.uint8)).nonzero()
        print(lens, f"quantize_qk: {len(flips)} bytes differ (rows {flips[:8, 0].tolist()}), "
              f"{int((asc != bsc).sum())} scales")
    want = attention_prefill(q_r, k, v, sinks, cu, max(lens), fp8=True)
    got = attention_prefill(q, k, v, sinks, cu, max(lens), fp8=True, rope=(cos, sin))
    bf = attention_prefill(q_r, k, v, sinks, cu, max(lens))
    print(lens, f"outputs differ {(got != want).float().mean().item():.2e}, max {(got - want).abs().max().item():.3e}, "
          f"rel {rel(got, want):.2e}; against bf16: rotated first {rel(want, bf):.2e}, fused {rel(got, bf):.2e}",
          flush=True)

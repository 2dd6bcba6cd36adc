"""Which outputs of the FP8 Gluon attention come back non-finite at small T, and why (H200).

The GPU tests fill and free a NaN block before a launch so that its torch.empty buffers reuse it
(tests/kernels/test_attention.py::_poison). This probe launches ``ws_attention_prefill_fp8`` per
option set, T and head shape in three ways: (a) the output pre-filled with NaN and the allocator
clean (non-finite rows here were never written), (b) the output zeroed and every buffer the launcher
allocates drawn from NaN-filled memory (non-finite here: something read that nobody wrote),
(c) both clean. Prints counts, the rows and heads hit, and the error against spec.attention_fp8.

    PYTHONPATH=$PWD python3 benchmarks/attn_poison_probe.py
"""

from __future__ import annotations

import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention_ws_fp8 import ws_attention_prefill_fp8

D = 64
OPTIONS = {"64-key": dict(pairs=False), "pairs": dict(pairs=True), "pairs+ones": dict(pairs=True, ones=True)}


def _poison_pool(n_bytes: int) -> None:
    """NaN over many small and large blocks, then freed: the caching allocator hands them out next."""
    keep = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
            for n in (512, 4096, 32768, 262144, n_bytes // 2) for _ in range(4)]
    del keep


def main() -> None:
    for name, opts in OPTIONS.items():
        for T in (1, 63, 64, 65, 129, 200, 1000):
            for hq, hkv in ((64, 8), (8, 1), (16, 2)):
                g = torch.Generator(device="cuda").manual_seed(T * 3 + hq)
                fused = torch.randn(T, (hq + 2 * hkv) * D, device="cuda", generator=g).bfloat16()
                q, k, v = (t.view(T, -1, D) for t in fused.split([hq * D, hkv * D, hkv * D], dim=1))
                sinks = torch.rand(hq, device="cuda", generator=g) * 20 - 10
                ref = spec.attention_fp8(q, k, v, sinks, D ** -0.5).float()
                line = [f"{name:10s} T={T:4d} hq={hq:2d} hkv={hkv}"]
                for mode in ("nan-out", "nan-pool", "clean"):
                    torch.cuda.synchronize()
                    if mode == "nan-out":
                        out = torch.full((T, hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
                    else:
                        out = torch.zeros((T, hq, D), dtype=torch.bfloat16, device="cuda")
                        if mode == "nan-pool":
                            _poison_pool(T * (hq + 2 * hkv) * D * 2)
                    ws_attention_prefill_fp8(q, k, v, sinks, out, D ** -0.5, **opts)
                    torch.cuda.synchronize()
                    o = out.float()
                    bad = ~torch.isfinite(o)
                    if bad.any():
                        rows = bad.any(dim=2).any(dim=1).nonzero().flatten().tolist()
                        heads = bad.any(dim=2).any(dim=0).nonzero().flatten().tolist()
                        line.append(f"{mode}: {int(bad.sum())} bad, rows {rows[:4]}..{rows[-2:]} ({len(rows)}), "
                                    f"heads {heads[:6]} ({len(heads)})")
                    else:
                        rel = ((o - ref).norm() / ref.norm()).item()
                        line.append(f"{mode}: ok rel {rel:.1e}")
                print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()

"""Router kernel accuracy on the GPU at gpt-oss shapes: logits against the float64 product rounded
once (in bf16 ulps of the reference value), ids against the kernel's own logits and against torch's
route, weights against the softmax of the selected logits. Prints counts, not pass/fail.

Usage (GPU machine): python3 benchmarks/router_accuracy.py
"""

from __future__ import annotations

import torch

from gptoss_fp8.kernels.router import router, router_config, router_reference


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the bf16 spacing at |want| (2^(floor(log2|want|) - 7))."""
    w = want.double().abs().clamp_min(2.0**-126)
    spacing = torch.exp2(torch.floor(torch.log2(w)) - 7)
    return (got.double() - want.double()).abs() / spacing


def main() -> None:
    for t, e in ((8192, 32), (4099, 128), (32768, 32)):
        g = torch.Generator().manual_seed(t * e + 4)
        h, k = 2880, 4
        x = torch.randn(t, h, generator=g).bfloat16().cuda()
        w = (torch.randn(e, h, generator=g) / h**0.5).bfloat16().cuda()
        b = (0.1 * torch.randn(e, generator=g)).bfloat16().cuda()
        exact = x.double() @ w.double().T + b.double()
        for cfg in (None, (32, 4, 4), (64, 4, 3), (64, 4, 5), (16, 4, 1)):
            logits, ids, wts = router(x, w, b, k, config=cfg)
            u = ulps(logits, exact.to(torch.bfloat16))
            fp32_err = (logits.double() - exact).abs() / exact.abs().clamp_min(1e-3)
            own = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k]
            _, ref_ids, ref_w = router_reference(x, w, b, k)
            same_set = (ids.long().sort(-1).values == ref_ids.sort(-1).values).all(-1)
            sel = torch.gather(logits.float(), 1, ids.long())
            wu = ulps(wts, torch.softmax(sel, -1).to(torch.bfloat16))
            print(f"T={t} E={e} cfg={cfg or router_config(t, e, True)}: logits ulps max {u.max().item():.1f}, "
                  f"> 1 ulp {int((u > 1).sum())} of {u.numel()}, max rel err vs fp64 {fp32_err.max().item():.2e}; "
                  f"ids == own top-k {bool(torch.equal(ids.long(), own))}; same expert set as torch "
                  f"{same_set.float().mean().item():.4f}; weights ulps max {wu.max().item():.1f}", flush=True)
            if u.max() > 1:
                i = int(u.flatten().argmax())
                r, c = divmod(i, e)
                print(f"   worst: row {r} col {c}: kernel {logits[r, c].item()!r} exact {exact[r, c].item()!r} "
                      f"rounded {exact.to(torch.bfloat16)[r, c].item()!r}", flush=True)


if __name__ == "__main__":
    main()

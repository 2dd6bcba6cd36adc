"""What does one launch that only reads a batch-1 decode's KV cost? The issue's decode target
(batch 1, 32768 cached tokens: 67 MB of K and V) is 0.83 of the HBM floor, 19.0 us at 4.26 TB/s.
This times plain streaming-read kernels (no attention math) over the same bytes, with the same
graph-replay timing and the same rotation through 4 caches (cold L2) as the decode benchmark,
beside attention_decode's default, and at batch 8 for the per-byte slope.

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/decode_read_probe.py``
"""
import torch
import triton
import triton.language as tl

from gptoss_fp8.bench.kernels_attention import COPY_BW, HQ, _decode_inputs, _ms_graph
from gptoss_fp8.kernels.attention_decode import attention_decode


@triton.jit
def _read_kernel(K, V, Out, n, per_prog, BLOCK: tl.constexpr):
    """Program p sums K and V elements [p * per_prog, (p + 1) * per_prog) below n (per_prog % BLOCK == 0)."""
    base = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_prog, BLOCK):
        idx = base + off + tl.arange(0, BLOCK)
        ok = idx < n
        acc += tl.load(K + idx, mask=ok, other=0.0).to(tl.float32) + tl.load(V + idx, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(acc))


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    for B in (1, 8):
        L = 32768
        sets = _decode_inputs(B, 1, L, gen)
        n = sets[0][1].numel()
        floor_us = 2 * n * 2 / COPY_BW * 1e6
        out = torch.empty(4096, device="cuda")
        sinks = torch.linspace(-10, 10, HQ, device="cuda")
        kl = torch.full((B,), L, dtype=torch.int32, device="cuda")
        us = _ms_graph([lambda q=q, kc=kc, vc=vc, kl=kl, s=sinks: attention_decode(q, kc, vc, kl, s) for q, kc, vc in sets]) * 1e3
        print(f"B={B}: {2 * n * 2 / 1e6:.1f} MB, floor {floor_us:.1f} us | attention_decode {us:.1f} us "
              f"({floor_us / us:.2f} of floor)", flush=True)
        for progs in (132, 264, 528, 1056, 2112):
            for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
                per = -(-n // (progs * block)) * block
                grid, kw = (progs,), {"BLOCK": block, "num_warps": warps}
                fns = [lambda kc=kc, vc=vc, a=(out, n, per), g=grid, kw=kw: _read_kernel[g](kc, vc, *a, **kw)
                       for _, kc, vc in sets]
                us = _ms_graph(fns) * 1e3
                print(f"B={B} read: {progs} programs, block {block}, {warps} warps: {us:.1f} us "
                      f"({floor_us / us:.2f} of floor)", flush=True)


if __name__ == "__main__":
    main()

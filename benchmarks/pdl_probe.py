"""What would programmatic dependent launch (PDL) save a decode step? A probe, not a kernel of ours.

A batch-1 decode step is ~270 short kernels (2-25 us each) in one CUDA graph; each starts only
when the one before has drained, then ramps its loads up from nothing. With PDL (sm_90:
``launch_pdl=True`` and ``griddepcontrol``), a kernel is launched while its predecessor runs its
last wave, waits in ``gdc_wait`` for the predecessor's writes, and can issue loads that do not
depend on them (weights) before that wait.

This times a chain of LAYERS dependent weight-streaming kernels (y_i = W_i x_i, x_{i+1} = y_i:
each reads the previous one's output; W_i fp8 [N, N], a different matrix per kernel, > L2 in
all) in one CUDA graph, three ways: plain launches; PDL with the wait at the top; PDL with the
first weight tile loaded before the wait. Reported: us per kernel (median of replays / LAYERS),
the weight bytes' GB/s, and whether the PDL variants' outputs equal the plain one's bit for bit.

Run on the GPU machine: ``PYTHONPATH=$(pwd) python3 benchmarks/pdl_probe.py``
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _stream_kernel(W, X, Y, N, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w_ptr = W + rows.to(tl.int64)[:, None] * K + cols[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    if PREFETCH:  # the first weight tile does not depend on the previous kernel: load it before the wait
        w0 = tl.load(w_ptr, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x0 = tl.load(X + cols, mask=cols < K, other=0.0)
        acc += tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
        start = BLOCK_K
    else:
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        start = 0
    for k0 in range(start, K, BLOCK_K):
        ok = (k0 + cols) < K
        w = tl.load(w_ptr + k0, mask=row_ok[:, None] & ok[None, :], other=0.0)
        x = tl.load(X + k0 + cols, mask=ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(Y + rows, acc / K, mask=row_ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2880)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--block-n", type=int, default=16)
    p.add_argument("--replays", type=int, default=30)
    a = p.parse_args()
    assert torch.cuda.is_available(), "the probe runs on the GPU machine"
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(a.n, a.n, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn) for _ in range(a.layers)]
    x0 = torch.randn(a.n, device="cuda", generator=g)
    bufs = [torch.empty(a.n, device="cuda") for _ in range(a.layers)]
    grid = (triton.cdiv(a.n, a.block_n),)

    def chain(pdl: bool, prefetch: bool) -> None:
        x = x0
        for w, y in zip(ws, bufs, strict=True):
            _stream_kernel[grid](w, x, y, a.n, a.n, PDL=pdl, PREFETCH=prefetch, BLOCK_N=a.block_n, BLOCK_K=128,
                                 num_warps=4, num_stages=4, launch_pdl=pdl)
            x = y

    nbytes = a.n * a.n
    base = None
    for name, pdl, prefetch in (("plain", False, False), ("pdl", True, False), ("pdl+prefetch", True, True)):
        try:
            chain(pdl, prefetch)  # compile
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(pdl, prefetch)
            times = []
            for _ in range(a.replays):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / a.layers)
            out = bufs[-1].clone()
            same = "" if base is None else f", output {'identical' if torch.equal(out, base) else 'DIFFERS'} to plain"
            base = out if base is None else base
            us = statistics.median(times)
            print(f"{name:>13}: {us:6.2f} us per kernel, {nbytes / us / 1e3:6.0f} GB/s of weights{same}", flush=True)
        except Exception as ex:  # noqa: BLE001 - report and go on (PDL under graph capture may be refused)
            print(f"{name:>13}: FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)


if __name__ == "__main__":
    main()

"""Repro: Triton 3.6's automatic Hopper warp specialization (``tl.range(..., warp_specialize=True)``)
hangs at the first launch on the H200 (device machine, 2026-11-29), even for a plain FP8 GEMM.

It compiles (a producer + two consumer partitions, setmaxnreg 232/40 with num_warps=4), but every
launch tried never returned (25-90 s timeouts): modes 0 (plain dot), 1 (scalar scale), 2 (row
scales x scalar scale), K 2880 and 4096; with ``warp_specialize=False`` mode 2 ran in 572 us.
Usage (GPU): timeout 30 python3 benchmarks/repro_triton_autows_hang.py MODE WS M N K
   e.g. ``0 1 8192 5120 4096`` (hangs), ``2 0 8192 5120 4096`` (runs). Rerun after a Triton upgrade.
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def kern(a_d, b_d, c_ptr, as_ptr, bs_ptr, K, stride_cm, stride_as, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         MODE: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0); pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        a = a_d.load([pid_m * BM, kb * BK]); b = b_d.load([pid_n * BN, kb * BK]).T
        if MODE == 0:
            acc = tl.dot(a, b, acc)
        elif MODE == 1:
            acc += tl.dot(a, b) * tl.load(bs_ptr + kb)
        else:
            acc += tl.dot(a, b) * (tl.load(as_ptr + offs_m * stride_as + kb) * tl.load(bs_ptr + kb))[:, None]
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(tl.bfloat16))

mode, ws, M, N, K = (int(v) for v in sys.argv[1:6])
a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn); b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
s_a = torch.rand(M, triton.cdiv(K, 128), device="cuda"); s_b = torch.rand(triton.cdiv(K, 128), device="cuda")
c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
ad = TensorDescriptor.from_tensor(a, [128, 128]); bd = TensorDescriptor.from_tensor(b, [128, 128])
grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))
run = lambda: kern[grid](ad, bd, c, s_a, s_b, K, c.stride(0), s_a.stride(0), BM=128, BN=128, BK=128, MODE=mode, WS=bool(ws), num_warps=4, num_stages=3)
print("compiling", flush=True)
k = run(); torch.cuda.synchronize()
print("ran once", flush=True)
from triton.testing import do_bench_cudagraph

t = do_bench_cudagraph(run, rep=50)
print(f"mode {mode} ws {ws} M{M} N{N} K{K}: {t*1e3:.1f} us, {2*M*N*K/t/1e9:.0f} TFLOP/s", flush=True)

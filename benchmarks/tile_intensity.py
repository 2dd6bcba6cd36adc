"""EXPERIMENT: is our FP8 GEMM bound by L2 -> shared-memory traffic (tile size) rather than by the
tensor cores? Times, in one process on the same data:

- a plain FP8 GEMM in Triton (tl.dot on e4m3, fp32 accumulator, bf16 out, no block scales, TMA
  loads) at tiles 128x128, 128x256 and 256x128: a tile of BM x BN with BK = 128 loads
  (BM + BN) * 128 bytes per 2 * BM * BN * 128 FLOPs, i.e. 128 / 171 / 171 FLOP per byte;
- our block-scaled ``fp8_gemm`` (128 x 128 tiles);
- torch ``_scaled_mm`` tensorwise and blockwise (1x128 / 128x128 scales, no bias) for the ceiling.

If the plain 128x128 GEMM stops near our kernel's rate while the larger tiles go well past it, the
tile's bytes per FLOP (L2 bandwidth), not the scale promotion, is what holds our kernels back.
Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/tile_intensity.py``.
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _plain_fp8_gemm(a_desc, b_desc, c_ptr, M, N, K, stride_cm,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(tl.bfloat16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def plain(a, b, BM, BN, warps, stages):
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    ad = TensorDescriptor.from_tensor(a, [BM, 128])
    bd = TensorDescriptor.from_tensor(b, [BN, 128])
    grid = (triton.cdiv(m, BM) * triton.cdiv(n, BN),)
    return lambda: _plain_fp8_gemm[grid](ad, bd, c, m, n, k, c.stride(0), BM=BM, BN=BN, BK=128, GROUP_M=8,
                                         num_warps=warps, num_stages=stages)


def main():
    from gptoss_fp8.kernels.fp8_gemm import fp8_gemm
    from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(8192, 5120, 2880), (8192, 2880, 4096), (8192, 5760, 2880)]:
        x, xs = quantize_act(torch.randn(m, k, device="cuda", generator=g))
        w, wsc = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=g) / 30)
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        f = 2 * m * n * k
        cands = {"ours fp8_gemm (block scales, bias, 128x128)": lambda: fp8_gemm(x, xs, w, wsc, bias)}
        one = torch.ones((), device="cuda")
        cands["torch _scaled_mm tensorwise"] = lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=torch.bfloat16)
        a_s = xs.t().contiguous().t()
        cands["torch _scaled_mm blockwise (no bias)"] = lambda: torch._scaled_mm(
            x, w.t(), scale_a=a_s, scale_b=wsc.t(), out_dtype=torch.bfloat16)
        for bm, bn, warps, stages in [(128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3), (128, 256, 8, 4),
                                      (256, 128, 8, 3), (256, 128, 8, 4)]:
            cands[f"plain Triton FP8 {bm}x{bn} w{warps} s{stages}"] = plain(x, w, bm, bn, warps, stages)
        for rep in range(2):
            for name, fn in cands.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    t = do_bench_cudagraph(fn, rep=30)
                    print(f"{m}x{n}x{k} pass {rep} {name}: {t * 1e3:.1f} us ({f / t / 1e9:.0f} TFLOP/s)", flush=True)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                    print(f"{m}x{n}x{k} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    main()

"""EXPERIMENT, not used by the package: warp-specialized block-scaled FP8 GEMMs (+ bias) in Gluon
(triton 3.6's explicit layout / barrier / partition dialect) for sm_90.

Why: Triton's tile language on Hopper cannot warp-specialize our kernels (``tl.range(...,
warp_specialize=True)`` compiles but hangs at the first launch on the H200, even for a plain FP8
GEMM: benchmarks/repro_triton_autows_hang.py), and without it the block-scaled main loops and the
attention cannot overlap their non-MMA work with the tensor cores (benchmarks/notes). Gluon gives
explicit warp specialization, mbarriers, TMA and wgmma.

Kernels: one TMA producer warp (40 registers); the default partition = two consumer warpgroups
(64 rows each of a 128 x 128 tile, 232-240 registers) that issue the wgmma of K block i + 1 before
waiting for block i, then promote block i's fresh product with its 1x128 activation scales and the
128x128 weight scale (the numerics of kernels/fp8_gemm.py); bias in the epilogue, bf16 out.
``ws_fp8_gemm_kernel``: one tile per program. ``ws_fp8_gemm_persistent_kernel``: one program per SM
walking tiles in grouped order; the producer runs ahead into the next tile during the epilogue.

Measured (H200, 2026-11-29 sixth session, ``python3 benchmarks/gluon_ws_gemm.py``, CUDA-graph
device time): the tile-per-program kernel, correct (relative error 1.67e-3 against the fp32
reference, the bf16 output rounding) on its first run, 8192x5120x2880: 343 us (704 TFLOP/s) vs
ours 310-325 us (743-780); 8192x2880x4096: 277-294 us (657-697) vs ours 237-239 us (808-814).
Second run (scales loaded one K step ahead in the persistent kernel): 8192x5120x2880 ours 309 us
(783 TFLOP/s); tile per program 340 us (711), persistent 3 stages 346 us (699), 4 stages 335 us
(722); 8192x2880x4096 ours 237 us (817); 274 us (705), 262 us (737), 258 us (750). All with the
same 1.67e-3 error. So 0.86-0.92x of our Triton kernel so far: benchmarks/notes/kernels_gemm.md
(sixth session) says what to try next.
Run on the GPU machine: PYTHONPATH=. python3 benchmarks/gluon_ws_gemm.py [M N K] (each variant in its
own process with a 90 s timeout). The two-partition variant (``ws_fp8_gemm_split_kernel``) was
compiled for sm_90 here (each consumer warpgroup syncs only its own 128 threads) but NOT yet run;
after the two measured runs the persistent consumer and the two-partition one were merged into one
function (``_consume``, A rows as a slice of the stage buffer) and recompiled, not re-run; the
TMA-store epilogue (``tma_store=True``: bias-added bf16 tile to shared memory, asynchronous TMA
store, waited for before the next tile's) was likewise only compiled (164 KB of shared memory).
"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gptoss_fp8.kernels import sm_count


@gluon.jit
def _stage_ring(a_desc, b_desc, STAGES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                CONSUMERS: gl.constexpr):
    """STAGES A / B tile buffers with their barriers: ``ready`` (TMA bytes landed), ``empty`` (each
    of the CONSUMERS partitions has released the stage)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=CONSUMERS)
        mbarrier.init(ready.index(i), count=1)
    return a_bufs, b_bufs, empty, ready


@gluon.jit
def _load_part(a_desc, b_desc, empty, ready, a_bufs, b_bufs, off_m, off_n, n_k, BK: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    for i in range(n_k):
        s = i % S
        ph = (i // S) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _mma_part(empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, stride_asm, stride_bsn, stride_cm,
              off_m, off_n, n_k, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    rmask = rows < M
    acc = gl.zeros((BM, BN), gl.float32, layout)
    zero = gl.zeros((BM, BN), gl.float32, layout)
    s_b_ptr = bs_ptr + (off_n // 128) * stride_bsn
    # MMA i + 1 is issued before MMA i is waited for and promoted: the tensor cores stay busy
    # while the fresh product of step i is scaled into acc.
    mbarrier.wait(ready.index(0), 0)
    cur = warpgroup_mma(a_bufs.index(0), b_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    for i in range(n_k - 1):
        j = i + 1
        sj = j % S
        mbarrier.wait(ready.index(sj), (j // S) & 1)
        nxt = warpgroup_mma(a_bufs.index(sj), b_bufs.index(sj).permute((1, 0)), zero, use_acc=False, is_async=True)
        scale = gl.load(as_ptr + rows * stride_asm + i, mask=rmask, other=0.0) * gl.load(s_b_ptr + i)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(cur,))
        mbarrier.arrive(empty.index(i % S), count=1)
        acc = acc + done * gl.expand_dims(scale, 1)
        cur = nxt
    last = n_k - 1
    scale = gl.load(as_ptr + rows * stride_asm + last, mask=rmask, other=0.0) * gl.load(s_b_ptr + last)
    done = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
    mbarrier.arrive(empty.index(last % S), count=1)
    acc = acc + done * gl.expand_dims(scale, 1)
    acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64), 1) * stride_cm + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rmask, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def ws_fp8_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_asm, stride_bsn, stride_cm,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr):
    a_bufs, b_bufs, empty, ready = _stage_ring(a_desc, b_desc, STAGES, BM, BN, BK, 1)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32])
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    off_m = pid_m * BM
    off_n = pid_n * BN
    n_k = gl.cdiv(K, BK)
    gl.warp_specialize([
        (_mma_part, (empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, stride_asm, stride_bsn,
                     stride_cm, off_m, off_n, n_k, BM, BN, layout)),
        (_load_part, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, off_m, off_n, n_k, BK)),
    ], [1], [40])


@gluon.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Grouped tile order: GROUP_M row tiles sweep the column tiles together (L2 reuse)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group


@gluon.jit
def _load_part_p(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    n_k = gl.cdiv(K, BK)
    c = 0  # k steps issued by this program over all its tiles: stage c % S, phase (c // S) & 1
    for tile in range(gl.program_id(0), num_m * num_n, num_progs):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        for kk in range(n_k):
            s = c % S
            mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kk * BK], ready.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _consume(ROW0: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr, empty, ready, a_bufs, b_bufs, as_ptr,
             bs_ptr, bias_ptr, c_ptr, c_smem, M, N, K, stride_asm, stride_bsn, stride_cm, num_progs,
             BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr):
    """Persistent consumer of rows ROW0 .. ROW0 + ROWS of every BM x BN tile (the whole tile with
    both warpgroups in one partition, or one warpgroup's half in a partition of its own).
    TMA_STORE: c_ptr is a descriptor (block [ROWS, BN]); the tile goes out through c_smem [ROWS, BN]
    with an asynchronous TMA store, waited for only before c_smem is written again."""
    S: gl.constexpr = a_bufs.type.shape[0]
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    n_k = gl.cdiv(K, BK)
    zero = gl.zeros((ROWS, BN), gl.float32, layout)
    c = 0
    for tile in range(gl.program_id(0), num_m * num_n, num_progs):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        rows = pid_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        rmask = rows < M
        s_b_ptr = bs_ptr + (pid_n * BN // 128) * stride_bsn
        acc = gl.zeros((ROWS, BN), gl.float32, layout)
        s = c % S
        scale = gl.load(as_ptr + rows * stride_asm, mask=rmask, other=0.0) * gl.load(s_b_ptr)
        mbarrier.wait(ready.index(s), (c // S) & 1)
        cur = warpgroup_mma(a_bufs.index(s).slice(ROW0, ROWS), b_bufs.index(s).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        for kk in range(n_k - 1):
            c1 = c + 1
            s1 = c1 % S
            mbarrier.wait(ready.index(s1), (c1 // S) & 1)
            nxt = warpgroup_mma(a_bufs.index(s1).slice(ROW0, ROWS), b_bufs.index(s1).permute((1, 0)), zero,
                                use_acc=False, is_async=True)
            # the next block's scales, loaded one step ahead (their latency hides behind this step)
            scale_next = gl.load(as_ptr + rows * stride_asm + kk + 1, mask=rmask, other=0.0) * gl.load(s_b_ptr + kk + 1)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(cur,))
            mbarrier.arrive(empty.index(c % S), count=1)
            acc = acc + done * gl.expand_dims(scale, 1)
            scale = scale_next
            cur = nxt
            c = c1
        done = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
        mbarrier.arrive(empty.index(c % S), count=1)
        acc = acc + done * gl.expand_dims(scale, 1)
        c += 1
        # epilogue: the producer is already loading this program's next tile
        acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
        if TMA_STORE:
            tma.store_wait(0)
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_ptr, [pid_m * BM + ROW0, pid_n * BN], c_smem)
        else:
            ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64), 1) * stride_cm + gl.expand_dims(cols, 0)
            gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rmask, 1) & gl.expand_dims(cols < N, 0))
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def ws_fp8_gemm_persistent_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_asm, stride_bsn,
                                  stride_cm, num_progs, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                                  STAGES: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr,
                                  num_warps: gl.constexpr):
    a_bufs, b_bufs, empty, ready = _stage_ring(a_desc, b_desc, STAGES, BM, BN, BK, 1)
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_ptr.layout)
    else:
        c_smem = a_bufs  # unused
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32])
    gl.warp_specialize([
        (_consume, (0, BM, layout, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, c_smem, M, N, K,
                    stride_asm, stride_bsn, stride_cm, num_progs, BM, BN, BK, GROUP_M, TMA_STORE)),
        (_load_part_p, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, BM, BN, BK, GROUP_M)),
    ], [1], [40])


@gluon.constexpr_function
def _warpgroup_layout(BN):
    """wgmma accumulator layout of one warpgroup (4 warps, 64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])


@gluon.jit
def _split_worker_consumer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, c_bufs, M, N,
                           K, stride_asm, stride_bsn, stride_cm, num_progs, BM: gl.constexpr, BN: gl.constexpr,
                           BK: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr):
    _consume(BM // 2, BM // 2, _warpgroup_layout(BN), empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr,
             c_bufs.index(1) if TMA_STORE else c_bufs, M, N, K, stride_asm, stride_bsn, stride_cm, num_progs, BM, BN, BK,
             GROUP_M, TMA_STORE)


@gluon.jit
def _split_worker_loader(a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, c_bufs, M, N,
                         K, stride_asm, stride_bsn, stride_cm, num_progs, BM: gl.constexpr, BN: gl.constexpr,
                         BK: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr):
    _load_part_p(a_desc, b_desc, empty, ready, a_bufs, b_bufs, M, N, K, num_progs, BM, BN, BK, GROUP_M)


@gluon.jit
def ws_fp8_gemm_split_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_asm, stride_bsn,
                             stride_cm, num_progs, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                             STAGES: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr,
                             num_warps: gl.constexpr):
    """Persistent, with the two consumer warpgroups as separate partitions (default = rows 0..63,
    a 4-warp worker = rows 64..127) and a 1-warp TMA worker; a stage is free when both arrived."""
    a_bufs, b_bufs, empty, ready = _stage_ring(a_desc, b_desc, STAGES, BM, BN, BK, 2)
    if TMA_STORE:
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BM // 2, BN], c_ptr.layout)
    else:
        c_bufs = a_bufs  # unused
    gl.warp_specialize([
        (_consume, (0, BM // 2, _warpgroup_layout(BN), empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr,
                    c_bufs.index(0) if TMA_STORE else c_bufs, M, N, K, stride_asm, stride_bsn, stride_cm, num_progs,
                    BM, BN, BK, GROUP_M, TMA_STORE)),
        (_split_worker_consumer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, c_bufs,
                                  M, N, K, stride_asm, stride_bsn, stride_cm, num_progs, BM, BN, BK, GROUP_M, TMA_STORE)),
        (_split_worker_loader, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, as_ptr, bs_ptr, bias_ptr, c_ptr, c_bufs,
                                M, N, K, stride_asm, stride_bsn, stride_cm, num_progs, BM, BN, BK, GROUP_M, TMA_STORE)),
    ], [4, 1], [232, 40])


def ws_fp8_gemm(x, xs, w, ws, bias, BM=128, BN=128, STAGES=4, num_warps=8, persistent=False, GROUP_M=8, split=False,
                tma_store=False):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    a_l = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.float8e4nv)
    b_l = gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv)
    a_d = TensorDescriptor.from_tensor(x, [BM, 128], a_l)
    b_d = TensorDescriptor.from_tensor(w, [BN, 128], b_l)
    if persistent or split:
        num_progs = min(triton.cdiv(m, BM) * triton.cdiv(n, BN), sm_count(x.device))
        kernel = ws_fp8_gemm_split_kernel if split else ws_fp8_gemm_persistent_kernel
        c = out
        if tma_store:  # one store box per consumer partition
            rows = BM // 2 if split else BM
            c = TensorDescriptor.from_tensor(out, [rows, BN], gl.NVMMASharedLayout.get_default_for([rows, BN], gl.bfloat16))
        kernel[(num_progs,)](
            a_d, b_d, xs, ws, bias, c, m, n, k, xs.stride(0), ws.stride(0), out.stride(0), num_progs,
            BM=BM, BN=BN, BK=128, STAGES=STAGES, GROUP_M=GROUP_M, TMA_STORE=tma_store, num_warps=4 if split else num_warps)
        return out
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    ws_fp8_gemm_kernel[grid](a_d, b_d, xs, ws, bias, out, m, n, k, xs.stride(0), ws.stride(0), out.stride(0),
                             BM=BM, BN=BN, BK=128, STAGES=STAGES, num_warps=num_warps)
    return out


VARIANTS = {  # name -> ws_fp8_gemm keywords
    "tile per program, 4 stages": dict(STAGES=4),
    "persistent, 4 stages": dict(STAGES=4, persistent=True),
    "persistent, consumers as two partitions, 4 stages": dict(STAGES=4, split=True),
    "persistent, consumers as two partitions, 3 stages": dict(STAGES=3, split=True),
    "persistent, TMA-store epilogue, 4 stages": dict(STAGES=4, persistent=True, tma_store=True),
    "persistent, two partitions, TMA-store epilogue, 4 stages": dict(STAGES=4, split=True, tma_store=True),
}
SHAPES = [(8192, 5120, 2880), (8192, 2880, 4096)]


def _run_one(name: str, m: int, n: int, k: int) -> None:
    """One variant on one shape (its own process: a hang cannot stop the others)."""
    from triton.testing import do_bench_cudagraph

    from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
    from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    x, xs = quantize_act(torch.randn(m, k, device="cuda", generator=g))
    w, wsc = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=g) / 30)
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    f = 2 * m * n * k
    if name == "ours":
        t = do_bench_cudagraph(lambda: fp8_gemm(x, xs, w, wsc, b), rep=25)
        print(f"{m}x{n}x{k} ours (Triton, dense_config): {t*1e3:.1f} us ({f/t/1e9:.0f} TFLOP/s)", flush=True)
        return
    kw = VARIANTS[name]
    y = ws_fp8_gemm(x, xs, w, wsc, b, **kw)
    torch.cuda.synchronize()
    ref = fp8_gemm_reference(x, xs, w, wsc, b, torch.float32)
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    t = do_bench_cudagraph(lambda: ws_fp8_gemm(x, xs, w, wsc, b, **kw), rep=25)
    print(f"{m}x{n}x{k} gluon {name}: rel err {rel:.2e}, {t*1e3:.1f} us ({f/t/1e9:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    import subprocess

    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        _run_one(sys.argv[2], *(int(v) for v in sys.argv[3:6]))
        sys.exit(0)
    shapes = [tuple(int(v) for v in sys.argv[1:4])] if len(sys.argv) > 3 else SHAPES
    for m, n, k in shapes:
        for name in ["ours", *VARIANTS]:
            try:
                r = subprocess.run([sys.executable, __file__, "--one", name, str(m), str(n), str(k)], timeout=90,
                                   capture_output=True, text=True)
                lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and "Warning" not in ln]
                print(lines[-1] if lines else f"{name}: no output (exit {r.returncode})", flush=True)
            except subprocess.TimeoutExpired:
                print(f"{m}x{n}x{k} gluon {name}: TIMED OUT after 90 s (hang?)", flush=True)

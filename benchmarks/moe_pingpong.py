"""EXPERIMENT, not used by the package, NOT YET RUN ON A GPU (written 2026-11-29, seventh session,
after the device time was spent; compiled for sm_90 on CPU only): the MoE gate_up GEMM with
"ping-pong" consumer warpgroups.

Why: the package's Gluon gate_up (kernels/moe_ws.py) splits each 64 x 256 tile between two
warpgroups of 128 columns, which must exchange row maxima once per tile for the FP8 group of the
SwiGLU output, so their epilogues run at the same time and the tensor cores idle meanwhile; the
MoE runs at ~660 TFLOP/s against the dense Gluon GEMM's ~800.
Here each consumer warpgroup owns whole 64 x 256 tiles (its program's tiles 2i + W): per K block it
computes the two 128-column halves one after the other into a 64-register product that it
promotes into its 128 accumulator registers (192 in all, no in-flight overlap inside the
warpgroup), while the other warpgroup's products keep the tensor cores busy; its epilogue (bias,
SwiGLU, the row maxima of its own 128 outputs, FP8, TMA store) overlaps the other's main loop.
The producer interleaves the two tiles' K blocks in one stage ring (a stage is read by one
warpgroup: empty barriers of count 1).

Compiled for sm_90 here (``PYTHONPATH=. python3 benchmarks/moe_pingpong.py --compile``): it SPILLS,
224 bytes of stack with STL/LDL among the main loop's QGMMAs, although its partitions get the same
register budgets as the package's kernels (setmaxnreg 232 for the consumers, 40 for the producer,
read in the PTX) and the live tiles should take 64 + 64 accumulator + 64 product registers. Not
the separate zero tile (the product now reuses its own registers as the ignored accumulator input:
no change; nor an explicit fma for the promotion, nor synchronous wgmma). Bisected on CPU: the main
loop alone spills (epilogue removed: 248 bytes), in the default partition (the second consumer
emptied: still 248); with only one half, or with the first half accumulated by the wgmma itself
(use_acc=True, which breaks the promotion numerics), no spill. The cause was not found; fix it (or
use 64 x 192 tiles) before measuring.

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/moe_pingpong.py`` (target ``pingpong`` of
gpu_suite.sh): checks its act / act_scale against the package's Gluon gate_up on the same sorted
rows (the rows of real slots: FP8 values equal but for rare one-step flips, scales to 1e-6) and
times both at 8192 / 32768 tokens with 32 and 128 experts.
"""
import sys

import torch
import triton

from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels._gluon import (
    HAS_GLUON,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tile_coords,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from gptoss_fp8.kernels.moe_ws import swiglu_columns

assert HAS_GLUON, "needs triton's Gluon (3.6)"


@gluon.jit
def _pair(first, num_progs, total, num_m, num_n, block_expert_ptr, num_experts, GROUP_M: gl.constexpr):
    """The program's tiles first and first + num_progs: (coords, expert, used) of each."""
    pm0, pn0 = tile_coords(first, num_m, num_n, GROUP_M)
    e0 = gl.load(block_expert_ptr + pm0)
    second = gl.minimum(first + num_progs, total - 1)
    pm1, pn1 = tile_coords(second, num_m, num_n, GROUP_M)
    e1 = gl.load(block_expert_ptr + pm1)
    return pm0, pn0, e0, e0 < num_experts, pm1, pn1, e1, (first + num_progs < total) & (e1 < num_experts)


@gluon.jit
def _pp_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts, num_progs,
                GROUP_M: gl.constexpr):
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    num_n = gl.cdiv(N, TN)
    n_k = gl.cdiv(K, TK)
    total = num_m * num_n
    c = 0
    for first in range(gl.program_id(0), total, 2 * num_progs):
        pm0, pn0, e0, use0, pm1, pn1, e1, use1 = _pair(first, num_progs, total, num_m, num_n, block_expert_ptr,
                                                       num_experts, GROUP_M)
        for kk in range(n_k):
            if use0:
                c = _load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, pm0 * TM, e0 * N + pn0 * TN, kk * TK)
            if use1:
                c = _load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, pm1 * TM, e1 * N + pn1 * TN, kk * TK)


@gluon.jit
def _load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, a_row, b_row, k0):
    """Ring position c <- A rows a_row.. and W rows b_row.. at K offset k0; returns c + 1."""
    S: gl.constexpr = a_bufs.type.shape[0]
    s = c % S
    mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, k0], ready.index(s), a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [b_row, k0], ready.index(s), b_bufs.index(s))
    return c + 1


@gluon.jit
def _half_product(a_buf, b_buf, H0: gl.constexpr, HN: gl.constexpr, prev):
    """A @ B[H0 : H0 + HN]^T into the registers of ``prev`` (use_acc=False: its values are ignored,
    so no separate zero tile is kept live)."""
    tok = warpgroup_mma(a_buf, b_buf.slice(H0, HN).permute((1, 0)), prev, use_acc=False, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(tok,))


@gluon.jit
def _pp_consume(W: gl.constexpr, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                stride_osm, limit, num_progs, GROUP_M: gl.constexpr, ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr,
                EPS: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TK: gl.constexpr = a_bufs.type.shape[2]
    TN: gl.constexpr = b_bufs.type.shape[1]
    HN: gl.constexpr = TN // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
    num_n = gl.cdiv(N, TN)
    n_k = gl.cdiv(K, TK)
    total = num_m * num_n
    fresh = gl.zeros((TM, HN), gl.float32, layout)
    c = 0
    for first in range(gl.program_id(0), total, 2 * num_progs):
        pm0, pn0, e0, use0, pm1, pn1, e1, use1 = _pair(first, num_progs, total, num_m, num_n, block_expert_ptr,
                                                       num_experts, GROUP_M)
        size = use0.to(gl.int32) + use1.to(gl.int32)
        if W == 0:
            mine = use0
            pid_m = pm0
            pid_n = pn0
            expert = e0.to(gl.int64)
            offset = 0
        else:
            mine = use1
            pid_m = pm1
            pid_n = pn1
            expert = e1.to(gl.int64)
            offset = use0.to(gl.int32)
        if mine:
            rows = pid_m * TM + gl.arange(0, TM, layout=gl.SliceLayout(1, layout))
            a_s_ptr = as_ptr + rows * stride_asm
            b_s_ptr = bs_ptr + expert * stride_bse + (pid_n * TN // TK) * stride_bsn
            acc_lo = gl.zeros((TM, HN), gl.float32, layout)
            acc_hi = gl.zeros((TM, HN), gl.float32, layout)
            for kk in range(n_k):
                ci = c + kk * size + offset
                s = ci % S
                a_s = gl.load(a_s_ptr + kk)
                mbarrier.wait(ready.index(s), (ci // S) & 1)
                fresh = _half_product(a_bufs.index(s), b_bufs.index(s), 0, HN, fresh)
                acc_lo = acc_lo + fresh * gl.expand_dims(a_s * gl.load(b_s_ptr + kk), 1)
                fresh = _half_product(a_bufs.index(s), b_bufs.index(s), HN, HN, fresh)
                mbarrier.arrive(empty.index(s), count=1)
                # the last weight-scale block of N = 2I may be partial: its row index stays in range
                acc_hi = acc_hi + fresh * gl.expand_dims(a_s * gl.load(b_s_ptr + stride_bsn + kk,
                                                                      mask=pid_n * TN + HN < N, other=0.0), 1)
            cols = pid_n * TN + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
            b_row = bias_ptr + expert * stride_biase
            h_lo = swiglu_columns(acc_lo + gl.expand_dims(gl.load(b_row + cols, mask=cols < N, other=0.0).to(gl.float32), 0),
                                  cols < N, limit, ALPHA)
            h_hi = swiglu_columns(acc_hi + gl.expand_dims(gl.load(b_row + cols + HN, mask=cols + HN < N, other=0.0).to(gl.float32), 0),
                                  cols + HN < N, limit, ALPHA)
            amax = gl.maximum(gl.max(gl.abs(h_lo), axis=1), gl.max(gl.abs(h_hi), axis=1))
            scale_o = gl.maximum(amax, EPS) / FP8_MAX_C
            q_lo = gl.minimum(gl.maximum(h_lo / gl.expand_dims(scale_o, 1), -FP8_MAX_C), FP8_MAX_C)
            q_hi = gl.minimum(gl.maximum(h_hi / gl.expand_dims(scale_o, 1), -FP8_MAX_C), FP8_MAX_C)
            tma.store_wait(0)
            o_bufs.index(2 * W).store(q_lo.to(gl.float8e4nv))
            o_bufs.index(2 * W + 1).store(q_hi.to(gl.float8e4nv))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [pid_m * TM, pid_n * HN], o_bufs.index(2 * W))
            tma.async_copy_shared_to_global(out_desc, [pid_m * TM, pid_n * HN + HN // 2], o_bufs.index(2 * W + 1))
            srows = pid_m * TM + gl.arange(0, TM, layout=amax.type.layout)
            gl.store(out_s_ptr + srows * stride_osm + pid_n, scale_o)
        c += size * n_k
    tma.store_wait(0)


@gluon.jit
def _pp_second(a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
               block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
               stride_osm, limit, num_progs, GROUP_M: gl.constexpr, ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr,
               EPS: gl.constexpr):
    _pp_consume(1, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)


@gluon.jit
def _pp_producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                 block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                 stride_osm, limit, num_progs, GROUP_M: gl.constexpr, ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr,
                 EPS: gl.constexpr):
    _pp_produce(a_desc, b_desc, empty, ready, a_bufs, b_bufs, block_expert_ptr, num_m, N, K, num_experts, num_progs,
                GROUP_M)


@gluon.jit
def pingpong_gate_up_kernel(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr, block_expert_ptr, num_m, N,
                            K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase, stride_osm, limit,
                            num_progs, STAGES: gl.constexpr, GROUP_M: gl.constexpr, ALPHA: gl.constexpr,
                            FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TN, TK], b_desc.layout)
    o_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, TM, TN // 4], out_desc.layout)  # 2 per warpgroup
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)  # each stage is read by one consumer warpgroup
        mbarrier.init(ready.index(i), count=1)
    gl.warp_specialize([
        (_pp_consume, (0, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                       block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                       stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
        (_pp_second, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                      out_s_ptr, block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn,
                      stride_biase, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
        (_pp_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                        out_s_ptr, block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn,
                        stride_biase, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
    ], [4, 1], [232, 40])


def pingpong_gate_up(a, a_scale, w13, s13, b13, act, act_scale, block_expert, limit, stages=4, group_m=8):
    from gptoss_fp8.kernels.moe import SWIGLU_ALPHA
    from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX

    max_rows, k = a.shape
    e, n, _ = w13.shape
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor.from_tensor(a, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], fp8))
    b_desc = TensorDescriptor.from_tensor(w13.view(e * n, k), [256, 128], gl.NVMMASharedLayout.get_default_for([256, 128], fp8))
    out_desc = TensorDescriptor.from_tensor(act, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], fp8))
    num_m = max_rows // 64
    num_progs = min(num_m * triton.cdiv(n, 256), sm_count(a.device))
    pingpong_gate_up_kernel[(num_progs,)](
        a_desc, b_desc, a_scale, s13, b13, out_desc, act_scale, block_expert, num_m, n, k, e, a_scale.stride(0),
        s13.stride(0), s13.stride(1), b13.stride(0), act_scale.stride(0), float(limit), num_progs,
        STAGES=stages, GROUP_M=group_m, ALPHA=SWIGLU_ALPHA, FP8_MAX_C=FP8_MAX, EPS=ACT_EPS, num_warps=4,
    )


def main():
    from triton.testing import do_bench

    from gptoss_fp8.kernels.moe import SWIGLU_ALPHA, gather_act_quant, moe_align, route
    from gptoss_fp8.kernels.moe_ws import ws_moe_gemm
    from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX, quantize_weight_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    h = i = 2880
    for e in (32, 128):
        w13, s13 = quantize_weight_blocks(torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5)
        b13 = (torch.randn(e, 2 * i, device="cuda", generator=g) * 0.3).bfloat16()
        wr = (torch.randn(e, h, device="cuda", generator=g) * h**-0.5).bfloat16()
        br = torch.zeros(e, device="cuda").bfloat16()
        for t in (8192, 32768):
            x = (torch.randn(t, h, device="cuda", generator=g) * 1.5).bfloat16()
            _, ids = route(x, wr, br, 4)
            sorted_slots, block_expert = moe_align(ids, 0, e, 64)
            a, a_s = gather_act_quant(x, sorted_slots, 4)
            rows = sorted_slots.shape[0]
            outs = {}
            for name in ("package", "pingpong"):
                act = torch.zeros(rows, i, dtype=torch.float8_e4m3fn, device="cuda")
                act_s = torch.zeros(rows, triton.cdiv(i, 128), device="cuda")
                if name == "package":
                    def fn(act=act, act_s=act_s):
                        ws_moe_gemm(a, a_s, w13, s13, b13, act, act_s, sorted_slots, block_expert, t * 4, 7.0, True,
                                    SWIGLU_ALPHA, FP8_MAX, ACT_EPS)
                else:
                    def fn(act=act, act_s=act_s):
                        pingpong_gate_up(a, a_s, w13, s13, b13, act, act_s, block_expert, 7.0)
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as ex:  # noqa: BLE001 - a failing variant is a result
                    print(f"E={e} T={t} {name}: failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    continue
                outs[name] = (act, act_s)
                ms = do_bench(fn, warmup=25, rep=200)
                flops = 2.0 * t * 4 * 2 * i * h
                print(f"E={e} T={t} {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
            if len(outs) == 2:
                real = sorted_slots < t * 4
                (qa, sa), (qb, sb) = outs["package"], outs["pingpong"]
                fa, fb = qa[real].float(), qb[real].float()
                flips = (fa != fb).float().mean().item()
                srel = ((sa[real] - sb[real]).abs() / sa[real].abs().clamp_min(1e-30)).max().item()
                print(f"E={e} T={t} pingpong vs package: fp8 values differing {flips:.2e}, scales max rel {srel:.2e}",
                      flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--compile":  # CPU: compile for sm_90 and report
        from gptoss_fp8.kernels._gluon import compile_for_sm90

        L = "NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth=8, rank=2, transposed=False, fp4_padded=False, cga_layout=[])"
        k = compile_for_sm90(pingpong_gate_up_kernel, {
            "a_desc": f"tensordesc<fp8e4nv[64, 128],{L.format(128)}>", "b_desc": f"tensordesc<fp8e4nv[256, 128],{L.format(128)}>",
            "out_desc": f"tensordesc<fp8e4nv[64, 64],{L.format(64)}>", "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "bias_ptr": "*bf16", "out_s_ptr": "*fp32", "block_expert_ptr": "*i32", "limit": "fp32"},
            dict(STAGES=4, GROUP_M=8, ALPHA=1.702, FP8_MAX_C=448.0, EPS=1e-10))
        ptx = k["ptx"]
        print("warps", k["num_warps"], "shared", k["shared"], "local memory" if ".local" in ptx else "no local memory",
              "wgmma", ptx.count("wgmma.mma_async"))
    else:
        main()

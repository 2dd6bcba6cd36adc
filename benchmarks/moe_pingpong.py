"""EXPERIMENT, not used by the package, NOT YET RUN ON A GPU (written 2026-11-29, seventh session,
after the device time was spent; compiled for sm_90 on CPU only): the MoE gate_up GEMM with
"ping-pong" consumer warpgroups.

Why: the package's Gluon gate_up (kernels/moe_ws.py) splits each 64 x 256 tile between two
warpgroups of 128 columns, which must exchange row maxima once per tile for the FP8 group of the
SwiGLU output, so their epilogues run at the same time and the tensor cores idle meanwhile; the
MoE runs at ~660 TFLOP/s against the dense Gluon GEMM's ~800.

Here each consumer warpgroup owns whole 64 x 256 tiles (its program's tiles 2i + W) and computes a
tile in two passes over K, 128 interleaved gate/up columns each, with the dense kernel's main loop
(K block i + 1 issued before block i is promoted: 64 accumulator + 2 x 64 product registers). The
first pass's 64 SwiGLU outputs wait in shared memory (16 KB per warpgroup) with their row maxima
in registers; after the second pass the warpgroup has the whole 128-wide FP8 group and quantizes
and stores both halves (TMA), with no exchange, so one warpgroup's epilogue overlaps the other's
main loop. A is read twice per tile (+20% operand bytes; the tile probe of this session shows L2
bandwidth is not the limit). The producer interleaves the two warpgroups' K blocks in one ring of
24 KB stages (each read by one warpgroup: empty barriers of count 1).

A first form (each warpgroup holding both 128-column accumulators, 192 registers, the halves
computed one after the other) spilled 224-248 bytes inside its main loop when compiled for sm_90,
for a cause not found (git history); this form keeps the dense kernel's register shape.

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/moe_pingpong.py`` (target ``pingpong`` of
gpu_suite.sh): checks its act / act_scale against the package's Gluon gate_up on the same sorted
rows (the rows of real slots: FP8 values equal but for rare one-step flips, scales to 1e-6) and
times both at 8192 / 32768 tokens with 32 and 128 experts. ``--compile`` compiles it for sm_90
(no GPU needed) and reports warps, shared memory and local memory.
"""
import sys

import torch
import triton

from gptoss_fp8.kernels import sm_count
from gptoss_fp8.kernels._gluon import (
    HAS_GLUON,
    TensorDescriptor,
    block_scaled_mainloop,
    fence_async_shared,
    gl,
    gluon,
    load_stage,
    mbarrier,
    tile_coords,
    tma,
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
    HN: gl.constexpr = b_desc.block_type.shape[0]  # columns per pass; a tile is 2 HN wide
    TK: gl.constexpr = a_desc.block_type.shape[1]
    num_n = gl.cdiv(N, 2 * HN)
    n_k = gl.cdiv(K, TK)
    total = num_m * num_n
    c = 0
    for first in range(gl.program_id(0), total, 2 * num_progs):
        pm0, pn0, e0, use0, pm1, pn1, e1, use1 = _pair(first, num_progs, total, num_m, num_n, block_expert_ptr,
                                                       num_experts, GROUP_M)
        for p in gl.static_range(2):
            for kk in range(n_k):
                if use0:
                    c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pm0 * TM, kk * TK],
                                   [e0 * N + (2 * pn0 + p) * HN, kk * TK])
                if use1:
                    c = load_stage(a_desc, b_desc, empty, ready, a_bufs, b_bufs, c, [pm1 * TM, kk * TK],
                                   [e1 * N + (2 * pn1 + p) * HN, kk * TK])


@gluon.jit
def _pp_consume(W: gl.constexpr, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                out_s_ptr, block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn,
                stride_biase, stride_osm, limit, num_progs, GROUP_M: gl.constexpr, ALPHA: gl.constexpr,
                FP8_MAX_C: gl.constexpr, EPS: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    TM: gl.constexpr = a_bufs.type.shape[1]
    TK: gl.constexpr = a_bufs.type.shape[2]
    HN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
    num_n = gl.cdiv(N, 2 * HN)
    n_k = gl.cdiv(K, TK)
    total = num_m * num_n
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
            b_row = bias_ptr + expert * stride_biase
            amax = gl.zeros((TM,), gl.float32, gl.SliceLayout(1, layout))
            for p in gl.static_range(2):  # columns 2 HN pid_n + p HN ..: one half of the FP8 group
                col0 = (2 * pid_n + p) * HN
                c0 = c + p * n_k * size + offset
                if col0 < N:
                    b_s_ptr = bs_ptr + expert * stride_bse + (col0 // TK) * stride_bsn
                    acc, _ = block_scaled_mainloop(ready, empty, a_bufs, b_bufs, 0, TM, 0, HN, a_s_ptr, rows, b_s_ptr,
                                                   c0, n_k, layout, False, size)
                else:  # all columns past N: only keep the stage ring in step
                    acc = gl.zeros((TM, HN), gl.float32, layout)
                    for kk in range(n_k):
                        ci = c0 + kk * size
                        mbarrier.wait(ready.index(ci % S), (ci // S) & 1)
                        mbarrier.arrive(empty.index(ci % S), count=1)
                cols = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, layout))
                acc = acc + gl.expand_dims(gl.load(b_row + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
                h = swiglu_columns(acc, cols < N, limit, ALPHA)
                amax = gl.maximum(amax, gl.convert_layout(gl.max(gl.abs(h), axis=1), amax.type.layout))
                if p == 0:
                    h_bufs.index(W).store(h)  # the first half waits here for the group's scale
            scale_o = gl.maximum(amax, EPS) / FP8_MAX_C
            sc = gl.expand_dims(gl.convert_layout(scale_o, gl.SliceLayout(1, h.type.layout)), 1)
            q1 = gl.minimum(gl.maximum(h / sc, -FP8_MAX_C), FP8_MAX_C)
            q0 = gl.minimum(gl.maximum(h_bufs.index(W).load(h.type.layout) / sc, -FP8_MAX_C), FP8_MAX_C)
            tma.store_wait(0)
            o_bufs.index(2 * W).store(q0.to(gl.float8e4nv))
            o_bufs.index(2 * W + 1).store(q1.to(gl.float8e4nv))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [pid_m * TM, pid_n * HN], o_bufs.index(2 * W))
            tma.async_copy_shared_to_global(out_desc, [pid_m * TM, pid_n * HN + HN // 2], o_bufs.index(2 * W + 1))
            gl.store(out_s_ptr + rows * stride_osm + pid_n, scale_o)
        c += 2 * size * n_k
    tma.store_wait(0)


@gluon.jit
def _pp_second(a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
               block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
               stride_osm, limit, num_progs, GROUP_M: gl.constexpr, ALPHA: gl.constexpr, FP8_MAX_C: gl.constexpr,
               EPS: gl.constexpr):
    _pp_consume(1, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)


@gluon.jit
def _pp_producer(a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
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
    HN: gl.constexpr = b_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TM, TK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, HN, TK], b_desc.layout)
    o_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, TM, HN // 2], out_desc.layout)  # 2 per warpgroup
    h_bufs = gl.allocate_shared_memory(gl.float32, [2, TM, HN // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)  # each stage is read by one consumer warpgroup
        mbarrier.init(ready.index(i), count=1)
    gl.warp_specialize([
        (_pp_consume, (0, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc, out_s_ptr,
                       block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn, stride_biase,
                       stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
        (_pp_second, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                      out_s_ptr, block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn,
                      stride_biase, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
        (_pp_producer, (a_desc, b_desc, empty, ready, a_bufs, b_bufs, o_bufs, h_bufs, as_ptr, bs_ptr, bias_ptr, out_desc,
                        out_s_ptr, block_expert_ptr, num_m, N, K, num_experts, stride_asm, stride_bse, stride_bsn,
                        stride_biase, stride_osm, limit, num_progs, GROUP_M, ALPHA, FP8_MAX_C, EPS)),
    ], [4, 1], [232, 40])


def pingpong_gate_up(a, a_scale, w13, s13, b13, act, act_scale, block_expert, limit, stages=6, group_m=8):
    from gptoss_fp8.kernels.moe import SWIGLU_ALPHA
    from gptoss_fp8.quant.fp8 import ACT_EPS, FP8_MAX

    max_rows, k = a.shape
    e, n, _ = w13.shape
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor.from_tensor(a, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], fp8))
    b_desc = TensorDescriptor.from_tensor(w13.view(e * n, k), [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], fp8))
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
            "a_desc": f"tensordesc<fp8e4nv[64, 128],{L.format(128)}>", "b_desc": f"tensordesc<fp8e4nv[128, 128],{L.format(128)}>",
            "out_desc": f"tensordesc<fp8e4nv[64, 64],{L.format(64)}>", "as_ptr": "*fp32", "bs_ptr": "*fp32",
            "bias_ptr": "*bf16", "out_s_ptr": "*fp32", "block_expert_ptr": "*i32", "limit": "fp32"},
            dict(STAGES=6, GROUP_M=8, ALPHA=1.702, FP8_MAX_C=448.0, EPS=1e-10))
        ptx = k["ptx"]
        print("warps", k["num_warps"], "shared", k["shared"], "local memory" if ".local" in ptx else "no local memory",
              "wgmma", ptx.count("wgmma.mma_async"))
    else:
        main()

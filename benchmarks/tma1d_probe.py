"""Where a TMA copy's box may start (thirty-sixth session: the stage-scales tiles, ``GluonTile.stage_scales``, stop
with "illegal instruction" at their scale copies, by compute-sanitizer).

Copies a box of fp32 from element offset TMA_OFF (default 37) of a flat tensor into shared memory by TMA and back out:
a rank-1 descriptor into a [2, BOX] buffer's second row (as ``load_stage_scaled``), the same into a [BOX] buffer, a
rank-2 descriptor over the tensor viewed [1, L] (box [1, BOX]), and as controls 2-D bf16 boxes (no swizzle; the
128-byte swizzle ``_gluon.descriptor`` gives every other copy here); each without and with a fence between the
barrier's initialisation and the copy (TMA_WAYS picks). Each in its own process (an illegal instruction poisons the
context). Prints one line a way: OK / WRONG / the error.

Measured (H100, triton 3.6, 2026-12-05): every way copies right from offset 32, the fp32 ones from 36 too, and every
way, the controls included, stops with "illegal instruction" at the copy (compute-sanitizer: the TMA instruction,
thread 0) from 37, the bf16 ones from 36: **a tiled TMA copy's innermost start must be a multiple of 16 bytes**
(the box's own size already is). The stage-scales tiles start their scale boxes at any element.

    PYTHONPATH=$(pwd) TMA_OFF=37 TMA_WAYS=0,1,2,3,4 python3 benchmarks/tma1d_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from gptoss_fp8.kernels._gluon import TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma

BOX = 128


@gluon.jit
def _probe(desc, out_ptr, off, WAY: gl.constexpr, FENCE: gl.constexpr):
    B: gl.constexpr = desc.block_type.shape[desc.block_type.shape.__len__() - 1]
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    if FENCE:  # the barrier's initialisation made visible to the async proxy (TMA) before its first use
        fence_async_shared()
        gl.thread_barrier()
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if WAY == 0:  # rank 1 into a [2, B] buffer's row 1
        buf = gl.allocate_shared_memory(gl.float32, [2, B], desc.layout)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [off], bar, buf.index(1))
        mbarrier.wait(bar, 0)
        x = buf.index(1).load(lay)
    elif WAY == 1:  # rank 1 into a [B] buffer
        buf = gl.allocate_shared_memory(gl.float32, [B], desc.layout)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [off], bar, buf)
        mbarrier.wait(bar, 0)
        x = buf.load(lay)
    elif WAY >= 3:  # a 2-D bf16 box (the kind every other TMA copy here is): the harness's control
        buf = gl.allocate_shared_memory(desc.dtype, [8, B], desc.layout)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [0, off], bar, buf)
        mbarrier.wait(bar, 0)
        l2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, l2))
        x = gl.sum(gl.where(gl.expand_dims(rows, 1) == 0, buf.load(l2).to(gl.float32), 0.0), 0)  # row 0
        x = gl.convert_layout(x, lay)
    else:  # rank 2, [1, L] with a box [1, B]
        buf = gl.allocate_shared_memory(gl.float32, [1, B], desc.layout)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [0, off], bar, buf)
        mbarrier.wait(bar, 0)
        x = gl.reshape(buf.load(gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])), [B])
        x = gl.convert_layout(x, lay)
    gl.store(out_ptr + gl.arange(0, B, layout=lay), x)


def run(way: int, fence: bool) -> str:
    L, off = 1000, int(os.environ.get("TMA_OFF", "37"))
    src = torch.randn(L + 3, device="cuda")[:L]  # 16-byte aligned base, length not a multiple of 4
    out = torch.empty(BOX, device="cuda")
    out_n = 64 if way == 4 else BOX
    if way < 2:
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        desc = TensorDescriptor.from_tensor(src, [BOX], lay)
    elif way == 2:
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        desc = TensorDescriptor(src, [1, L], [(L + 3) // 4 * 4, 1], [1, BOX], lay)
    else:  # way 3: swizzle none; way 4: the default layout (what _gluon.descriptor gives every other copy)
        src = src.bfloat16().float()
        src16 = torch.zeros(8, 1024, dtype=torch.bfloat16, device="cuda")
        src16[0, :L] = src.bfloat16()
        box = BOX if way == 3 else 64  # (64 bf16: a 128-byte row, the 128-byte swizzle's span)
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0 if way == 3 else 128, element_bitwidth=16, rank=2)
        desc = TensorDescriptor.from_tensor(src16, [8, box], lay)
    _probe[(1,)](desc, out, off, WAY=way, FENCE=fence, num_warps=4)
    torch.cuda.synchronize()
    want = torch.zeros(BOX, device="cuda")
    n = min(out_n, L - off)
    want[:n] = src[off:off + n]
    out, want = out[:out_n], want[:out_n]
    return "OK" if torch.equal(out, want) else f"WRONG (max diff {(out - want).abs().max().item():.3g})"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(run(int(sys.argv[1]), sys.argv[2] == "1"))
    else:
        import triton

        print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
        ways = ("rank 1 into a [2, BOX] row", "rank 1 into [BOX]", "rank 2 [1, L], box [1, BOX]", "control: bf16 [8, BOX]",
                "control: bf16 [8, 64], 128-byte swizzle (as _gluon.descriptor)")
        picks = [int(w) for w in os.environ.get("TMA_WAYS", "0,1,2,3,4").split(",")]
        for fence, (way, what) in ((f, (w, ways[w])) for f in (0, 1) for w in picks):
            what = f"{what}{', barrier init fenced' if fence else ''}"
            r = subprocess.run([sys.executable, __file__, str(way), str(fence)], capture_output=True, text=True)
            errs = [x for x in r.stderr.splitlines() if "Error" in x and not x.startswith(" ")]
            tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else (errs or ["?"])[-1][-300:]
            print(f"{what}: {tail}", flush=True)

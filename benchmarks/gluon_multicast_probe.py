"""Does triton's Gluon lower a TMA load into a shared layout broadcast over a 2-CTA cluster to a multicast load?

DeepGEMM's MoE GEMMs multicast the weight tile to the two SMs of a cluster (16% more FLOPs per L2 byte than ours,
BENCHMARKS.md, twenty-seventh session); Gluon's TMA load takes no multicast mask, but its layouts carry a
``cga_layout`` (how a cluster's CTAs tile a tensor) and kernels a ``num_ctas``. This compiles, without a GPU, one TMA
load of a 128 x 128 e4m3 tile into a shared layout with CGA bases CGA (``[[0, 0]]``: both CTAs hold the same tile)
under NUM_CTAS and prints the PTX's bulk-tensor copies: ``.multicast::cluster`` in them would say yes.

    python benchmarks/gluon_multicast_probe.py '[[0, 0]]' 2     # triton 3.6: a plain copy per CTA (no multicast)
    python benchmarks/gluon_multicast_probe.py '[]' 1           # the single-CTA baseline
"""

from __future__ import annotations

import ast
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def _load_tile(a_desc, out_ptr, LAYOUT: gl.constexpr, BLK: gl.constexpr):
    smem = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], LAYOUT)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [gl.program_id(0) * 128, 0], bar.index(0), smem)
    mbarrier.wait(bar.index(0), 0)
    x = smem.load(BLK)
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, BLK))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, BLK))
    gl.store(out_ptr + gl.expand_dims(rows, 1) * 128 + gl.expand_dims(cols, 0), x)


def main() -> None:
    cga, num_ctas = ast.literal_eval(sys.argv[1]), int(sys.argv[2])
    lay = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, cga_layout=cga)
    blk = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0], cga_layout=cga)
    lay_s = ("NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, transposed=False, "
             f"fp4_padded=False, cga_layout={cga})")
    sig = {"a_desc": f"tensordesc<fp8e4nv[128, 128],{lay_s}>", "out_ptr": "*fp8e4nv", "LAYOUT": "constexpr",
           "BLK": "constexpr"}
    k = triton.compile(GluonASTSource(_load_tile, sig, {"LAYOUT": lay, "BLK": blk}, {}),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4, num_ctas=num_ctas, num_stages=1))
    copies = [ln.strip() for ln in k.asm["ptx"].splitlines() if "cp.async.bulk.tensor" in ln]
    print("\n".join(copies))
    print(f"num_ctas {k.metadata.num_ctas}: {'multicast' if any('multicast' in c for c in copies) else 'no multicast'}")


if __name__ == "__main__":
    main()

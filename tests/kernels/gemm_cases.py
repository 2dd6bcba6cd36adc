"""Shared by the dense GEMM tests (test_fp8_gemm.py, test_fp8_gemv.py, test_gemm_q8.py): the random problem, the
tolerance check against the fp32 reference (test_fp8_gemm.py's docstring has the tolerances) and the Gluon kernel's
argument types for compiles without a GPU."""

from __future__ import annotations

import torch

from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
REL_ELEM, REL_NORM = (2.0**-8, 2e-3) if HAS_CUDA else (2.0**-7, 6e-3)


def dense_problem(m, n, k, seed, bias=torch.bfloat16, lead=None):
    """(x_fp8, x_scale, w_fp8, w_scale, bias) on DEV: rows of unlike scale quantized 1x128, a
    128x128-block weight, a bias of dtype ``bias`` (None: no bias); x reshaped to lead + [k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 3 * torch.rand(m, 1, generator=g))
    w = torch.randn(n, k, generator=g) * 0.05
    b = (torch.randn(n, generator=g) * 0.5).to(bias).to(DEV) if bias is not None else None
    x_fp8, x_scale = quantize_act(x.to(DEV))
    w_fp8, w_scale = quantize_weight_blocks(w.to(DEV))
    if lead is not None:
        x_fp8, x_scale = x_fp8.reshape(*lead, k), x_scale.reshape(*lead, -1)
    return x_fp8, x_scale, w_fp8, w_scale, b


def check_close(y, ref):
    """Every element written and within REL_ELEM |ref| + 1e-3 max|ref|, the norm within REL_NORM."""
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) or NaN outputs"
    y, ref = y.float(), ref.float()
    err = (y - ref).abs()
    bound = REL_ELEM * ref.abs() + 1e-3 * ref.abs().max()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e}, worst excess {(err - bound).max().item():.3e}"
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel <= REL_NORM, f"relative error {rel:.2e} > {REL_NORM:.0e}"


# the 128-byte-swizzled NVMMA shared layout of a 2-D TMA box, by element width (compile_for_sm90's type strings)
NVMMA_128B = ("NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={}, rank=2, transposed=False, "
              "fp4_padded=False, cga_layout=[])")


def dense_ws_types(bm: int, bn: int) -> dict[str, str]:
    """The Gluon dense GEMM's argument types as a launch gives them (``_gluon.compile_for_sm90``): A / B boxes of
    bm / bn rows x 128 e4m3, bf16 64 x 128 store boxes, fp32 scales, a bf16 bias."""
    return {"a_desc": f"tensordesc<fp8e4nv[{bm}, 128],{NVMMA_128B.format(8)}>",
            "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{NVMMA_128B.format(8)}>",
            "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
            "c_desc": f"tensordesc<bf16[64, 128],{NVMMA_128B.format(16)}>"}

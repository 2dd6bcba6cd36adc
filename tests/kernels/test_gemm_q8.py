"""``fp8_gemm.fp8_gemm_q8``: the full layers' q / k / v GEMM making Q rotated and quantized for the FP8 attention
(``KernelConfig.gemm_q_quant``). Its contract is ``fp8_gemm`` then ``attn_quant.quantize_qk(rope=)`` bit for bit:
checked on CPU through the interpreter (the two-launch form every device takes where the epilogue does not) and on
the GPU for the Gluon 128 x 256 tile's epilogue (ragged M: rows past M in the last tile; more tiles than programs;
both store-buffer counts), plus the kernel's compile without a GPU."""

import re

import pytest
import torch
from gemm_cases import DEV, NVMMA_128B, dense_problem, dense_ws_types

from gptoss_fp8 import spec
from gptoss_fp8.kernels import attn_quant
from gptoss_fp8.kernels.config import GluonTile, KernelConfig
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, fp8_gemm_q8, q8_in_epilogue

# the wide tile from the Gluon kernel's first row count (so the GPU cases stay small)
WIDE_EARLY = KernelConfig(dense_gluon_wide_min_rows=1)


def _case(m, n, k, q_cols, head_dim, seed, config=None):
    """fp8_gemm_q8's three outputs against the GEMM, then quantize_qk on its rotated Q columns, bit for bit."""
    x8, xs, w8, ws, b = dense_problem(m, n, k, seed, torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    cos, sin = (t.to(DEV) for t in spec.rope_table(m + 5, head_dim))
    # a bias large enough that Q's heads differ in scale (each head's own amax)
    b = (b.float() + 4 * torch.randn(n, generator=g).to(DEV)).bfloat16()
    q8, qs, rest = fp8_gemm_q8(x8, xs, w8, ws, b, q_cols, (cos, sin), config=config, head_dim=head_dim)
    y = fp8_gemm(x8, xs, w8, ws, b, config=config)
    want8, want_s = attn_quant.quantize_qk(y[:, :q_cols].reshape(m, q_cols // head_dim, head_dim), rope=(cos, sin))
    assert q8.shape == (m, q_cols // head_dim, head_dim) and qs.shape == want_s.shape
    assert torch.equal(rest, y[:, q_cols:]), "the columns after Q's: the GEMM's bf16"
    assert torch.equal(qs, want_s), (qs - want_s).abs().max()
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8)), (q8.float() - want8.float()).abs().max()
    assert torch.unique(qs).numel() >= min(qs.numel(), 8)  # (not one scale everywhere: each head and block its own)


@pytest.mark.parametrize("m,n,k,q_cols,d", [(70, 512, 160, 256, 64), (33, 384, 192, 128, 32)])
def test_fp8_gemm_q8_two_launches(m, n, k, q_cols, d):
    """Where the epilogue does not take the call (CPU, any tile but the Gluon 128 x 256, head_dim != 64): the
    GEMM, then quantize_qk on a view of its Q columns; the rest a view of its output."""
    _case(m, n, k, q_cols, d, seed=m + n)


def test_q8_in_epilogue_by_launch():
    """The epilogue quantizes where the default launch is the Gluon 128 x 256 tile and Q's columns are whole tiles
    of it: the 20b's q / k / v at 4096+ rows (4096 of 5120 columns), not at 2048 (the 128 x 128 tile), not without
    the Gluon kernel, not for Q columns that split a tile."""
    assert q8_in_epilogue(4096, 5120, 2880, 4096, gluon_ok=True) and q8_in_epilogue(32768, 5120, 2880, 4096, gluon_ok=True)
    assert not q8_in_epilogue(32768, 5120, 2880, 4096) and not q8_in_epilogue(2048, 5120, 2880, 4096, gluon_ok=True)
    assert not q8_in_epilogue(32768, 5120, 2880, 4160, gluon_ok=True)
    assert not q8_in_epilogue(32768, 4096, 2880, 4096, gluon_ok=True)  # (nothing after Q)
    assert q8_in_epilogue(300, 640, 160, 512, WIDE_EARLY, gluon_ok=True) is False  # (below dense_gluon_min_rows)
    assert q8_in_epilogue(1024, 640, 160, 512, WIDE_EARLY, gluon_ok=True)


def test_ws_fp8_gemm_q8_rejects_other_tiles():
    """``ws_fp8_gemm(q_fp8=)`` refuses tiles other than 128 x 256 and a residual beside it, before any launch."""
    from gptoss_fp8.kernels import fp8_gemm_ws

    x8, xs, w8, ws, b = dense_problem(64, 512, 128, 3, torch.bfloat16)
    out = torch.empty(64, 256, dtype=torch.bfloat16, device=DEV)
    q = (torch.empty(64, 256, dtype=torch.float8_e4m3fn, device=DEV), torch.empty(4, 1, device=DEV),
         torch.empty(64, 32, device=DEV), torch.empty(64, 32, device=DEV))
    with pytest.raises(ValueError, match="q_fp8: the 128 x 256 tile"):
        fp8_gemm_ws.ws_fp8_gemm(x8, xs, w8, ws, b, out, block_n=128, promote="serial", q_fp8=q)
    with pytest.raises(ValueError, match="with a residual"):
        fp8_gemm_ws.ws_fp8_gemm(x8, xs, w8, ws, b, out, block_n=256, promote="serial", q_fp8=q, residual=out)


def test_fp8_gemm_q8_compiles_for_sm90():
    """Without a GPU: the 128 x 256 kernel with Q quantized in its epilogue (the dense wide tile: 3 stages, two
    store buffers a warpgroup) compiles for sm_90: each warpgroup's e4m3 pieces leave by two more TMA stores
    (through the bf16 store buffers, reinterpreted), Q's scales by a plain store, IEEE quotients; the main loop's
    products pipelined (no C7514) and no more than a few words spilled (ptxas keeps some of the epilogue's
    addresses on the stack across the tile loop: 48 bytes measured with triton 3.6, none in the main loop)."""
    from gptoss_fp8.kernels import _gluon, fp8_gemm_ws

    if not _gluon.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API")
    types = dense_ws_types(128, 256) | {"q8_desc": f"tensordesc<fp8e4nv[64, 128],{NVMMA_128B.format(8)}>",
                                        "qs_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "nbq": "i32"}
    tile = KernelConfig().dense_gluon_wide_tile
    assert (tile.block_n, tile.stages, tile.stage_scales) == (256, 3, False), tile
    consts = dict(STAGES=3, GROUP_M=8, HAS_BIAS=True, C_BUFS=fp8_gemm_ws.wide_c_bufs(3), QN=4096)
    k = _gluon.compile_for_sm90(fp8_gemm_ws._ws_fp8_gemm_wide_kernel, types, consts,
                                divisible16=("as_ptr", "bs_ptr", "bias_ptr", "N", "K", "stride_asm", "stride_bsn"))
    ptx = k["ptx"]
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared::cta")
    assert stores == 2 * 2 * 2, stores  # each warpgroup: two bf16 pieces or two e4m3 ones
    assert "div.rn.f32" in ptx and re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    assert k["num_warps"] == 12 and k["shared"] <= 227 * 1024
    if "regs" in k:
        assert not k["wgmma_serialized"] and k["spill_stores"] <= 64, k


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from gptoss_fp8.kernels import fp8_gemm_ws

    if not fp8_gemm_ws.supported(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU with Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,q_cols,config", [
    (1100, 640, 160, 512, WIDE_EARLY),  # ragged M: the last 128-row tile's rows past M (the Gluon kernel from 1024)
    (1088, 1024, 2880, 512, WIDE_EARLY),  # whole tiles, K = 2880 (a half K block)
    (4097, 5120, 2880, 4096, None),  # the 20b's q / k / v on the default launch, one row past 4096
    (8192, 5120, 2880, 4096, None),  # more tiles than programs: each program's epilogue many times
    (1100, 640, 160, 512, KernelConfig(dense_gluon_wide_min_rows=1, dense_gluon_wide_tile=GluonTile(
        stages=4, group_m=8, block_n=256, promote="serial"))),  # one store buffer a warpgroup
])
def test_fp8_gemm_q8_epilogue_gpu(m, n, k, q_cols, config):
    """The Gluon 128 x 256 tile's epilogue: Q's e4m3 bytes and scales those of the GEMM then quantize_qk(rope=),
    the rest the GEMM's bf16, bit for bit."""
    _gpu()
    assert q8_in_epilogue(m, n, k, q_cols, config, gluon_ok=True)
    _case(m, n, k, q_cols, 64, seed=m + k, config=config)


def _q_scale_case(t, hq, hkv, seed):
    """attention_prefill(fp8=True) on Q made beforehand (attn_quant.quantize_qk(rope=): the GEMM epilogue's bytes)
    with q_scale against the bf16 q rotated in the attention's own pass: the same output bit for bit."""
    from gptoss_fp8.kernels.attention import attention_prefill

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, 64, generator=g).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g).to(DEV)
    rope = tuple(x.to(DEV) for x in spec.rope_table(t, 64))
    want = attention_prefill(q, k, v, sinks, sm_scale=0.125, fp8=True, rope=rope)
    q8, qs = attn_quant.quantize_qk(q, rope=rope)
    got = attention_prefill(q8, k, v, sinks, sm_scale=0.125, fp8=True, q_scale=qs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(AssertionError, match="q_scale"):
        attention_prefill(q8, k, v, sinks, sm_scale=0.125, fp8=True, q_scale=qs, rope=rope)
    with pytest.raises(AssertionError, match="q_scale"):
        attention_prefill(q8, k, v, sinks, sm_scale=0.125, fp8=True, q_scale=qs[:, :1])


def test_attention_takes_q_made_before():
    """Through the interpreter (the Triton FP8 kernel): a ragged last Q block."""
    _q_scale_case(70, 4, 2, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4097, 32768])
def test_attention_takes_q_made_before_gpu(t):
    """The Gluon FP8 kernel (one sequence, 64 q / 8 kv heads)."""
    _gpu()
    _q_scale_case(t, 64, 8, seed=t)

"""Dense FP8 block GEMM + bias (Triton) against quant/fp8.block_gemm_reference.

Inputs: fresh random x (quantized 1x128 with torch) and weights (128x128 pow2 blocks), random bias.
The reference is computed in fp32 (before the bf16 cast). Tolerances:
- GPU (bf16 round-to-nearest output, fp32 accumulation in a different order):
  |y - ref| <= 2^-8 |ref| + 1e-3 max|ref| elementwise, and ||y - ref|| / ||ref|| <= 2e-3.
- CPU interpreter (bf16 stores truncate instead of rounding: up to one bf16 ulp):
  |y - ref| <= 2^-7 |ref| + 1e-3 max|ref|, and ||y - ref|| / ||ref|| <= 6e-3.
The output is poisoned with NaN first, so every element must be written.
"""

from dataclasses import replace

import pytest
import torch
from gemm_cases import DEV, HAS_CUDA, REL_ELEM, check_close, dense_problem, dense_ws_types

from gptoss_fp8.kernels.config import GluonTile, KernelConfig, TritonTile
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference, fp8_linear
from gptoss_fp8.quant.fp8 import quantize_act, quantize_weight_blocks


def _problem(m, n, k, seed, bias=True, lead=None):
    return dense_problem(m, n, k, seed, torch.bfloat16 if bias else None, lead)


def _run(m, n, k, seed, bias=True, lead=None, tile=None):
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed, bias, lead)
    out = torch.full((*x_fp8.shape[:-1], n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, out=out, tile=tile)
    assert y.data_ptr() == out.data_ptr() and y.shape == (*x_fp8.shape[:-1], n)
    ref = fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32)
    check_close(y, ref)


# Small shapes through the interpreter on CPU: partial M/N/K tiles, K = 2880 and 160 (half groups),
# a 64-row k/v-like shard, no bias, 3-D activations.
@pytest.mark.parametrize(
    "m,n,k,bias",
    [(37, 320, 160, True), (5, 64, 2880, True), (130, 200, 288, False), (1, 192, 160, True), (20, 136, 2880, True)],
)
def test_fp8_gemm_small(m, n, k, bias):
    _run(m, n, k, seed=m * 7 + n, bias=bias)


# The kernel's variants: tensor-descriptor (TMA) loads, persistent tile loop, both; 128-wide tiles.
# (256-wide dense tiles, split or not, were measured slower and removed: notes/kernels_gemm.md.)
VARIANTS = [
    TritonTile(32, 64, group_m=2, num_warps=4, num_stages=3, tma=True),
    TritonTile(32, 64, group_m=2, num_warps=4, num_stages=3, tma=False, persistent=1),
    TritonTile(64, 32, group_m=3, num_warps=4, num_stages=3, tma=True, persistent=1),
    TritonTile(64, 32, group_m=3, num_warps=4, num_stages=3, tma=True, persistent=1, flatten=True),
    TritonTile(32, 128, group_m=2, num_warps=4, num_stages=3, tma=True, persistent=2, flatten=True),
    TritonTile(32, 128, group_m=2, num_warps=4, num_stages=3, tma=False),
]


@pytest.mark.parametrize(
    "tile", VARIANTS, ids=["tma", "persistent", "tma-persistent", "tma-persistent-flat", "tma-n128-2persm", "ptr-n128"]
)
@pytest.mark.parametrize("n", [200, 100])
def test_fp8_gemm_variants_small(tile, n):
    # N = 200: the last 128-column tile is partial; N = 100 with 128-wide tiles: one partial tile.
    _run(150, n, 288, seed=17 + n, tile=tile)


def _residual_case(m, n, k, seed, tile=None, bias=True):
    """fp8_gemm(residual=r) against r + the same launch without it: equal bit for bit on the GPU (the epilogue
    rounds the delta to bf16 and the sum again, as torch's bf16 add does), within one bf16 unit of the sum's last
    place through the interpreter (its bf16 stores truncate); and against the fp32 reference plus r."""
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 1)
    r = (torch.randn(m, n, generator=g) * 4).to(torch.bfloat16).to(DEV)  # residual rows larger than the delta's
    y0 = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=tile)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=tile, out=out, residual=r)
    assert y.data_ptr() == out.data_ptr()
    want = r + y0
    if HAS_CUDA:
        assert torch.equal(y, want), f"max diff {(y.float() - want.float()).abs().max().item():.3e}"
    else:
        ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-100))) - 7)
        assert bool(((y.float() - want.float()).abs() <= ulp).all())
    ref = fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32)
    # (the product's error as check_close's, then two roundings: the delta's, relative to it, and the sum's)
    err = (y.float() - r.float() - ref).abs()
    assert bool((err <= REL_ELEM * (r.float().abs() + 2 * ref.abs()) + 1e-3 * ref.abs().max()).all()), err.max()


# The residual added by the GEMM (o_proj's, KernelConfig.gemm_residual): the Triton tiles (default and forced,
# partial tiles), the skinny decode rows (added after the GEMM), no bias
@pytest.mark.parametrize("m,n,k,tile,bias", [
    (37, 320, 160, None, True), (5, 64, 2880, None, True), (130, 200, 288, None, False),
    (150, 200, 288, VARIANTS[0], True), (150, 100, 288, VARIANTS[4], True)],
    ids=["default", "skinny", "no-bias", "tma", "n128-2persm"])
def test_fp8_gemm_residual(m, n, k, tile, bias):
    _residual_case(m, n, k, seed=m + n, tile=tile, bias=bias)


def test_fp8_gemm_residual_rejects_bad_input():
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(20, 64, 160, seed=2)
    r = torch.zeros(20, 64, dtype=torch.bfloat16, device=DEV) + 1
    with pytest.raises(AssertionError, match="residual"):
        fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, residual=r[:, :32])
    with pytest.raises(AssertionError, match="residual"):
        fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, residual=r.float())
    with pytest.raises(AssertionError, match="overlap"):
        fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, residual=r, out=r)


def test_residual_in_epilogue_by_launch():
    """Where ``fp8_gemm(residual=)`` adds in the epilogue on the default launch: not the skinny decode rows or the
    Gluon 128 x 128 tile (a pass of its own there); the Triton tiles and the Gluon wide ones (o_proj's, 2880 x 4096,
    with two store buffers a warpgroup beside 3 stages; also with its stage scales), not the wide tile with 4."""
    from gptoss_fp8.kernels import fp8_gemm_ws
    from gptoss_fp8.kernels.fp8_gemm import residual_in_epilogue

    assert not residual_in_epilogue(16, 2880, 4096) and residual_in_epilogue(17, 2880, 4096)
    assert residual_in_epilogue(32768, 2880, 4096) and residual_in_epilogue(32768, 2880, 4096, gluon_ok=True)
    assert not residual_in_epilogue(2048, 5120, 2880, gluon_ok=True)  # the 128 x 128 Gluon tile
    assert fp8_gemm_ws.residual_fused(128, 256, 3, False, 4096) and fp8_gemm_ws.residual_fused(256, 128, 3, False, 2880)
    assert fp8_gemm_ws.residual_fused(128, 256, 3, True, 4096)
    assert not fp8_gemm_ws.residual_fused(128, 256, 4, False, 4096)  # one store buffer a warpgroup beside 4 stages
    assert not fp8_gemm_ws.residual_fused(128, 128, 5, False, 4096)
    wide4 = KernelConfig(dense_gluon_wide_tile=GluonTile(stages=4, group_m=8, block_n=256, promote="serial"))
    assert not residual_in_epilogue(32768, 2880, 4096, wide4, gluon_ok=True)


def test_default_tiles_are_the_measured_ones():
    """KernelConfig.dense_tile by size (the shipped launches), and the Gluon kernel from
    dense_gluon_min_rows rows where it can run: 128 x 128, or 128 x 256 from
    dense_gluon_wide_min_rows rows and for N <= 3072."""
    cfg = KernelConfig()
    assert cfg.dense_tile(8, 5120, 2880) == TritonTile(16, 64, group_m=1, num_warps=4, num_stages=4)
    assert cfg.dense_tile(64, 5120, 2880) == TritonTile(64, 64, group_m=1, num_warps=4, num_stages=4)
    assert cfg.dense_tile(512, 5120, 2880) == TritonTile(64, 128, group_m=8, num_warps=4, num_stages=5)
    assert cfg.dense_tile(1024, 2880, 4096) == TritonTile(64, 128, group_m=8, num_warps=4, num_stages=3)
    assert cfg.dense_tile(4096, 2880, 4096) == TritonTile(64, 128, 8, 4, 4, persistent=2, flatten=True)
    assert cfg.dense_tile(8192, 5120, 2880) == TritonTile(128, 128, 8, 8, 3, persistent=1, flatten=True)
    base = GluonTile(stages=5, group_m=8, balance=True, promote="serial")
    wide = GluonTile(stages=3, group_m=8, block_n=256, promote="serial")
    assert cfg.dense_tile(1024, 5120, 2880, gluon_ok=True) == base
    assert cfg.dense_tile(2048, 5760, 2880, gluon_ok=True) == base
    assert cfg.dense_tile(4096, 5120, 2880, gluon_ok=True) == wide
    assert cfg.dense_tile(1024, 2880, 4096, gluon_ok=True) == wide  # N <= 3072
    assert cfg.dense_tile(512, 2880, 4096, gluon_ok=True) == cfg.dense_tile(512, 2880, 4096)
    off = KernelConfig(dense_gluon_min_rows=None)
    assert off.dense_tile(8192, 5120, 2880, gluon_ok=True) == cfg.dense_tile(8192, 5120, 2880)


def test_fp8_gemm_3d_input():
    _run(12, 96, 160, seed=5, lead=(3, 4))


def test_fp8_linear_quantizes_like_the_spec():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 160, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w_fp8, w_scale = quantize_weight_blocks((torch.randn(72, 160, generator=g) * 0.05).to(DEV))
    b = torch.randn(72, generator=g).to(torch.bfloat16).to(DEV)
    x_fp8, x_scale = quantize_act(x)
    check_close(fp8_linear(x, w_fp8, w_scale, b), fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, torch.float32))


def test_fp8_gemm_rejects_bad_scales():
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(4, 64, 160, seed=1)
    with pytest.raises(AssertionError):
        fp8_gemm(x_fp8, x_scale[:, :1], w_fp8, w_scale, b)


# gpt-oss shapes on the GPU: qkv 5120x2880, o 2880x4096, expert-sized 5760x2880 and 2880x2880,
# k/v 512x2880, 64-row k/v shards, TP shards of the experts (1440 = 5760/4, K 720 = 2880/4),
# K = 160; M from 1 to 131072.
GPU_CASES = [
    (1, 5120, 2880), (33, 2880, 4096), (1024, 5760, 2880), (8192, 5120, 2880), (8192, 2880, 4096),
    (4096, 512, 2880), (3000, 64, 2880), (517, 1440, 2880), (2048, 2880, 720), (999, 2880, 160),
    (131072, 512, 2880),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_CASES)
def test_fp8_gemm_gpu(m, n, k):
    _run(m, n, k, seed=m + n + k)


GPU_VARIANTS = [
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=4, tma=False),
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=1),
    TritonTile(128, 128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=1, flatten=True),
    TritonTile(64, 128, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=2, flatten=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", GPU_VARIANTS, ids=["ptr", "tma-persistent", "tma-persistent-flat", "tma-2persm-flat"])
@pytest.mark.parametrize("m,n,k", [(3001, 2880, 2880), (200, 64, 160)])
def test_fp8_gemm_variants_gpu(m, n, k, tile):
    _run(m, n, k, seed=m + n, tile=tile)


# The warp-specialized Gluon kernel (kernels/fp8_gemm_ws.py, sm_90 only; fp8_gemm picks it from
# KernelConfig.dense_gluon_min_rows rows on). Forced here at odd shapes: M below and across tiles, N not a multiple of 128
# (2880, 136, and 64 < one tile), K with half groups (2880, 160), 3-D input, no bias, fp32 bias.
WS_CASES = [(4097, 2880, 2880, "bf16"), (200, 64, 160, "bf16"), (1, 136, 2880, None), (999, 5120, 4096, "fp32"),
            (8192, 5760, 2880, "bf16")]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,bias", WS_CASES)
def test_fp8_gemm_ws_gpu(m, n, k, bias):
    from gptoss_fp8.kernels import fp8_gemm_ws

    assert fp8_gemm_ws.supported(torch.device("cuda")), "the H200 (sm_90) must run the Gluon kernel"
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed=m + 3 * n + k, bias=bias is not None)
    if bias == "fp32":
        b = b.float()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, out=out, tile=GluonTile(stages=5))
    assert y.data_ptr() == out.data_ptr()
    check_close(y, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32))


@pytest.mark.gpu
def test_fp8_gemm_ws_3d_and_stages():
    for stages in (3, 5):
        x_fp8, x_scale, w_fp8, w_scale, b = _problem(6000, 512, 2880, seed=stages, lead=(2, 3000))
        y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=GluonTile(stages=stages, group_m=4))
        check_close(y, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32))


def test_fp8_gemm_ws_refused_where_it_cannot_run():
    # fp32 output (or, off the GPU, any call): a forced WS config is refused with a clear message
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(8, 64, 160, seed=2)
    with pytest.raises(AssertionError, match="GluonTile needs"):
        fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32, tile=GluonTile())


def test_fp8_gemm_ws_compiles_for_sm90():
    """Without a GPU: the Gluon kernel compiles for sm_90 into warp-specialized code (register
    reallocation between partitions, wgmma on fp8, TMA loads and stores, no local memory), within
    the shared memory of one SM."""
    import re

    from gptoss_fp8.kernels import _gluon, fp8_gemm_ws

    if not _gluon.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API; fp8_gemm uses the Triton kernel")
    types = dense_ws_types(128, 128)
    k = _gluon.compile_for_sm90(fp8_gemm_ws._ws_fp8_gemm_kernel, types, dict(STAGES=5, GROUP_M=8, HAS_BIAS=True))
    ptx = k["ptx"]
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx), "consumers get 232 registers"
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40", ptx), "the producer warp gives registers back"
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx and "cp.async.bulk.tensor.2d.global.shared" in ptx
    assert ".local" not in ptx, "register spills to local memory"
    assert k["num_warps"] == 4 + 4 + 4 and k["shared"] <= 227 * 1024


# The wave-balanced grid of the shipped (pipelined) 128 x 128 loop, at the base kernel's odd shapes.
# (The wide forms run only the serial promotion: their cases are SERIAL_TILES below; the in-place
# accumulation variants lost accuracy on the H200 and were removed with their tests.)
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,bias", WS_CASES + [(1000, 5120, 2880, "bf16")])
def test_fp8_gemm_ws_balanced_gpu(m, n, k, bias):
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed=m + 5 * n + k, bias=bias is not None)
    if bias == "fp32":
        b = b.float()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, out=out, tile=GluonTile(stages=5, balance=True))
    assert y.data_ptr() == out.data_ptr()
    check_close(y, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32))


def test_num_programs_keeps_waves():
    """The wave-balanced grid: the fewest programs that keep the number of waves."""
    from gptoss_fp8.kernels import _gluon

    assert _gluon.num_programs(2560, 132, False) == 132 and _gluon.num_programs(2560, 132, True) == 128
    assert _gluon.num_programs(40, 132, True) == 40 and _gluon.num_programs(1280, 132, True) == 128


def test_gluon_wide_tiles_refuse_pipelined():
    """The wide forms have only the serial promotion loop: promote="pipelined" (GluonTile's default)
    is refused before any launch, as is an unknown loop (also by GluonTile itself)."""
    from gptoss_fp8.kernels import fp8_gemm_ws

    for bm, bn in ((256, 128), (128, 256)):
        with pytest.raises(ValueError, match="only the serial promotion"):
            fp8_gemm_ws.ws_fp8_gemm(*[None] * 6, block_m=bm, block_n=bn)
    with pytest.raises(ValueError, match="promote="):
        fp8_gemm_ws.ws_fp8_gemm(*[None] * 6, promote="bogus")
    with pytest.raises(ValueError, match="turns=True.*not 128 x 128"):
        fp8_gemm_ws.ws_fp8_gemm(*[None] * 6, promote="serial", turns=True)
    for bm, bn in ((128, 128), (256, 128)):  # stage scales: the 128 x 256 tile's only (its products share A rows)
        with pytest.raises(ValueError, match=f"stage_scales=True.*not the {bm} x {bn} Gluon dense GEMM"):
            fp8_gemm_ws.ws_fp8_gemm(*[None] * 6, block_m=bm, block_n=bn, promote="serial", stage_scales=True)
    with pytest.raises(ValueError, match="promote"):
        GluonTile(promote="inplace")


def test_gluon_switch_and_report():
    """KernelConfig(gluon=False) keeps every call on the Triton kernels, decided before any CUDA
    query (so it also holds where torch cannot see a GPU), and the report line says why."""
    import dataclasses

    from gptoss_fp8.kernels.config import kernel_paths

    off = KernelConfig(gluon=False)
    assert off.gluon_on(torch.device("cuda")) is False
    assert kernel_paths(torch.device("cuda"), off) == "kernels: Triton (Gluon switched off (KernelConfig.gluon=False))"
    assert kernel_paths(torch.device("cpu")) == "kernels: Triton (interpreter on CPU)"
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(8, 64, 160, seed=4)
    with pytest.raises(AssertionError, match="GluonTile needs"):  # a forced Gluon tile is refused off sm_90
        fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, config=off, tile=GluonTile())
    # the config is frozen: variants are new objects (dataclasses.replace), never mutated in place
    with pytest.raises(dataclasses.FrozenInstanceError):
        off.gluon = True  # type: ignore[misc]


def test_host_helpers_match_triton():
    """The launchers' host-side helpers: next_pow2 / cdiv give triton's values, and the cached-layout
    TMA descriptor is the one triton builds from scratch (same base, shape, strides, block, layout)."""
    import triton

    from gptoss_fp8.kernels import _gluon
    from gptoss_fp8.quant.fp8 import cdiv, next_pow2

    for n in range(1, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n) and cdiv(n, 128) == triton.cdiv(n, 128), n
    if not _gluon.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API")
    gl = _gluon.gl
    for dtype, gdt, block in ((torch.float8_e4m3fn, gl.float8e4nv, [128, 128]), (torch.float8_e4m3fn, gl.float8e4nv, [64, 64]),
                              (torch.bfloat16, gl.bfloat16, [64, 128]), (torch.bfloat16, gl.bfloat16, [64, 64])):
        t = torch.empty(300, 256, dtype=dtype)
        want = _gluon.TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))
        for _ in range(2):  # built, then from the cache
            got = _gluon.descriptor(t, block)
            assert (got.base is want.base and list(got.shape) == list(want.shape) and list(got.strides) == list(want.strides)
                    and list(got.block_shape) == list(want.block_shape) and got.layout == want.layout), (got, want)


# promote="serial": the default's numerics (promotion every 128 into a separate fp32 accumulator),
# each K block's wgmmas waited for within their iteration (no C7514); the only loop of the wide
# forms. These call the Gluon launch with what fp8_gemm passes it for 2-D operands.
SERIAL_TILES = [GluonTile(stages=5, promote="serial"), GluonTile(stages=4, balance=True, promote="serial"),
                GluonTile(stages=3, block_m=256, promote="serial"), GluonTile(stages=4, block_m=256, promote="serial"),
                GluonTile(stages=3, block_n=256, promote="serial"),
                GluonTile(stages=4, block_n=256, balance=True, promote="serial"),
                GluonTile(stages=3, block_n=256, promote="serial", turns=True),
                GluonTile(stages=4, block_m=256, promote="serial", turns=True),
                GluonTile(stages=3, block_n=256, promote="serial", stage_scales=True),
                GluonTile(stages=3, block_n=256, balance=True, promote="serial", turns=True, stage_scales=True)]
SERIAL_IDS = ["128x128-s5", "128x128-s4-bal", "256x128-s3", "256x128-s4", "128x256-s3", "128x256-s4-bal",
              "128x256-s3-turns", "256x128-s4-turns", "128x256-s3-sc", "128x256-s3-bal-turns-sc"]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,tile", [
    (4000, 2880, 4096, GluonTile(stages=3, group_m=8, block_n=256, promote="serial")),
    (4000, 2880, 4096, GluonTile(stages=3, group_m=8, block_m=256, promote="serial")),
    (33000, 2880, 4096, None), (1030, 2880, 4096, None), (300, 2880, 4096, None), (2048, 5120, 2880, None)],
    ids=["128x256", "256x128", "default-32k", "default-1030", "triton-300", "gluon-128x128"])
def test_fp8_gemm_residual_gpu(m, n, k, tile):
    """The residual in the Gluon wide tiles' epilogue (o_proj's shape: more tiles than programs, so each
    program's next residual lands during its tile before; M past the last 64 rows; N = 2880: the last 128 x 256
    tile's second half wholly past N), the default launches (the wide tile from 1024 rows, the Triton one below,
    the 128 x 128 Gluon tile adding after its GEMM): bit for bit r + the launch without it."""
    _residual_case(m, n, k, seed=m + n + k, tile=tile)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,residual", [(4097, 2880, 4096, False), (4097, 2880, 4096, True), (300, 320, 160, False),
                                            (1000, 2880, 2880, True), (1000, 5120, 2880, False), (999, 640, 4096, False)])
def test_fp8_gemm_narrow_gpu(m, n, k, residual):
    """GluonTile.narrow on the 128 x 256 tile: where the last column tile's valid columns fit 64 (N = 2880, 320) it
    runs one m64n64 product a warpgroup; the same bits as without it (N = 5120, 640: unused), with and without the
    residual in the epilogue, and within the reference's tolerance."""
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed=m + n + k)
    tile = GluonTile(stages=3, group_m=8, block_n=256, promote="serial")
    r = torch.randn(m, n, device=DEV).bfloat16() if residual else None
    y = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=replace(tile, narrow=True), residual=r)
    assert torch.equal(y, fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=tile, residual=r))
    if not residual:
        check_close(y, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32))


def _ws_launch(x_fp8, x_scale, w_fp8, w_scale, b, out, tile):
    from gptoss_fp8.kernels import fp8_gemm_ws

    return fp8_gemm_ws.ws_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, out, stages=tile.stages, group_m=tile.group_m,
                                   block_m=tile.block_m or fp8_gemm_ws.BM, block_n=tile.block_n or fp8_gemm_ws.BN,
                                   balance=tile.balance, promote=tile.promote, turns=tile.turns,
                                   stage_scales=tile.stage_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", SERIAL_TILES, ids=SERIAL_IDS)
@pytest.mark.parametrize("m,n,k,bias", WS_CASES + [(1000, 5120, 2880, "bf16")])
def test_fp8_gemm_ws_serial_gpu(m, n, k, bias, tile):
    """The serial-promotion forms against the reference, and as accurate as the shipped promotion
    loop (the removed in-place forms measured 2.09e-3 relative against its 1.66e-3 on the H200:
    Hopper's FP8 wgmma accumulates in limited precision). GluonTile.stage_scales (the scales through
    the stages; rows past M and K blocks past the last read what TMA finds there, or its zeros): the
    same bits as the tile without it."""
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed=m + 7 * n + k, bias=bias is not None)
    if bias == "fp32":
        b = b.float()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = _ws_launch(x_fp8, x_scale, w_fp8, w_scale, b, out, tile)
    ref = fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32)
    check_close(y, ref)
    y0 = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=GluonTile(stages=5)).float()  # the shipped loop
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    rel0 = ((y0 - ref).norm() / ref.norm()).item()
    assert rel <= 1.02 * rel0 + 1e-5, f"serial {rel:.3e} vs the promotion loop's {rel0:.3e}"
    if tile.stage_scales:
        plain = _ws_launch(x_fp8, x_scale, w_fp8, w_scale, b, torch.empty_like(out), replace(tile, stage_scales=False))
        assert torch.equal(y, plain)


@pytest.mark.gpu
def test_fp8_gemm_ws_serial_extreme_scales():
    m, n, k = 512, 256, 1024
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, n, k, seed=11)
    x = torch.randn(m, k, device=DEV)
    x[:, 128:256] = 0.0
    x[::2, 256:384] *= 1e-6
    x[1::2, 512:640] *= 1e3
    x_fp8, x_scale = quantize_act(x)
    ref = fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32)
    for tile in SERIAL_TILES[::2]:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
        check_close(_ws_launch(x_fp8, x_scale, w_fp8, w_scale, b, out, tile), ref)


# (bm, bn, stages). 128 x 256 with 3 stages: KernelConfig.dense_gluon_wide_tile, the default from 8192
# rows. By default the square kernel and that wide tile (each form compiles in ~6 s on the 2-core box);
# under -m slow the other wide forms (256 x 128 at 3 and 4 stages, 128 x 256 at 4: the same
# _ws_fp8_gemm_wide_kernel as the default's 128 x 256 s3, other block shapes / stages).
# (with GluonTile.turns, slow: the wide kernel with its warpgroups' wgmmas in turns, 128 x 256 s3)
SERIAL_COMPILES = [pytest.param(128, 128, 5, False, id="128x128-s5"), pytest.param(128, 256, 3, False, id="128x256-s3"),
                   *(pytest.param(*c, False, id=f"{c[0]}x{c[1]}-s{c[2]}", marks=pytest.mark.slow)
                     for c in ((256, 128, 3), (256, 128, 4), (128, 256, 4))),
                   pytest.param(128, 256, 3, True, id="128x256-s3-turns", marks=pytest.mark.slow),
                   pytest.param(128, 256, 3, "sc", id="128x256-s3-sc", marks=pytest.mark.slow),
                   pytest.param(128, 256, 3, "res", id="128x256-s3-res", marks=pytest.mark.slow),
                   pytest.param(128, 256, 3, "narrow", id="128x256-s3-narrow", marks=pytest.mark.slow)]


@pytest.mark.parametrize("bm,bn,stages,turns", SERIAL_COMPILES)
def test_fp8_gemm_ws_serial_compiles_for_sm90(bm, bn, stages, turns):
    """Without a GPU: the serial-promotion forms compile for sm_90 with ptxas pipelining their wgmmas
    (no C7514) and, for 128 x 128 and 128 x 256, no spills (256 x 128: ptxas's report; measured
    96 bytes of spill stores with triton 3.6's ptxas, a few local loads/stores per K block); with
    turns, two more barriers (the warpgroups' turns) and a wait and an arrive around each product; with
    "narrow" (GluonTile.narrow) an m64n64 product too; "sc" (GluonTile.stage_scales, o_proj's K = 4096: a
    weight-scale box of 64) the two 1-D TMA copies
    of the scales on each stage's byte count (48 KB + 512 + 256 bytes), within shared memory; with "res"
    (``fp8_gemm(residual=)``): two more barriers (each warpgroup's residual), its two 64 x 128 tiles a
    warpgroup by TMA on one byte count (32 KB) from two places (before the tile loop, after a tile's stores),
    no spills."""
    import re

    from gptoss_fp8.kernels import _gluon, fp8_gemm_ws

    if not _gluon.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API; fp8_gemm uses the Triton kernel")
    types = dense_ws_types(bm, bn)
    sc = turns == "sc"
    if sc:
        flat = ("NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1, transposed=False, "
                "fp4_padded=False, cga_layout=[])")
        types |= {"sa_desc": f"tensordesc<fp32[128],{flat}>", "sb_desc": f"tensordesc<fp32[64],{flat}>"}
        turns = False
    res, narrow = turns == "res", turns == "narrow"
    if res:
        types["r_desc"] = types["c_desc"]
    if res or narrow:
        turns = False
    if bm == bn:
        fn, consts = fp8_gemm_ws._ws_fp8_gemm_kernel, dict(STAGES=stages, GROUP_M=8, HAS_BIAS=True, SERIAL=True)
    else:
        fn = fp8_gemm_ws._ws_fp8_gemm_wide_kernel
        consts = dict(STAGES=stages, GROUP_M=8, HAS_BIAS=True,
                      C_BUFS=fp8_gemm_ws.wide_c_bufs(stages, 4 * (128 + 64) if sc else 0),
                      **({"TURN": True} if turns else {}), **({"SC": True} if sc else {}),
                      **({"RES": True} if res else {}), **({"NARROW": True} if narrow else {}))
    k = _gluon.compile_for_sm90(fn, types, consts, divisible16=("as_ptr", "bs_ptr", "bias_ptr", "N", "K",
                                                                "stride_asm", "stride_bsn"))
    ptx = k["ptx"]
    assert ptx.count("mbarrier.init") == 2 * stages + 2 * turns + 2 * res
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert k["num_warps"] == 12 and k["shared"] <= 227 * 1024
    if "regs" in k:
        assert not k["wgmma_serialized"], ("ptxas serialized the serial promotion's wgmmas (C7514)", bm, bn, k)
        if bm == 128:
            assert k["spill_stores"] == 0 and k["stack"] == 0, (bm, bn, k)
    # (GluonTile.narrow: the last column tile's one m64n64 product a warpgroup beside the m64n128 ones)
    assert ("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx) == narrow
    if res:
        # the producer's A and B loads, then each warpgroup's two residual tiles at both issue points
        assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 + 2 * 2 * 2
        assert re.search(r"mbarrier\.arrive\.expect_tx\S*\s+\S+,\s*\[[^]]+\],\s*32768;", ptx)
        assert "regs" not in k or k["spill_stores"] == 0
    if sc:
        assert ptx.count("cp.async.bulk.tensor.1d.shared::cluster.global") == 2
        assert re.search(r"mbarrier\.arrive\.expect_tx\S*\s+\S+,\s*\[[^]]+\],\s*49920;", ptx)


@pytest.mark.parametrize("m,skinny", [(16, True), (17, False)])
def test_decode_sized_calls_take_the_skinny_kernel(monkeypatch, m, skinny):
    """Up to KernelConfig.dense_skinny_max_rows (16) rows fp8_gemm runs kernels/fp8_gemv.py (unless
    a tile is given), above it its own tiles; the same results either way."""
    from gptoss_fp8.kernels import fp8_gemv

    calls = []
    real = fp8_gemv.fp8_gemm_skinny
    monkeypatch.setattr(fp8_gemv, "fp8_gemm_skinny", lambda *a, **k: calls.append(1) or real(*a, **k))
    x_fp8, x_scale, w_fp8, w_scale, b = _problem(m, 200, 288, seed=60 + m)
    ref = fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, out_dtype=torch.float32)
    check_close(fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b), ref)
    assert len(calls) == (1 if skinny else 0)
    check_close(fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, config=KernelConfig(dense_skinny_max_rows=None)), ref)
    check_close(fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, b, tile=TritonTile(16, 64, group_m=1)), ref)
    assert len(calls) == (1 if skinny else 0)

"""Skinny (decode) FP8 block GEMM + bias, split-K (Triton), against quant/fp8.block_gemm_reference.

Inputs: fresh random x (quantized 1x128 with torch, rows of different magnitudes) and weights
(128x128 pow2 blocks), random bias; fixed seeds. The reference is computed in fp32 (before any
cast). Tolerances as for fp8_gemm (tests/kernels/test_fp8_gemm.py):
- GPU (round-to-nearest output, fp32 accumulation in a different order):
  |y - ref| <= 2^-8 |ref| + 1e-3 max|ref| elementwise, and ||y - ref|| / ||ref|| <= 2e-3.
- CPU interpreter (bf16 stores truncate instead of rounding: up to one bf16 ulp):
  |y - ref| <= 2^-7 |ref| + 1e-3 max|ref|, and ||y - ref|| / ||ref|| <= 6e-3.
Outputs are poisoned with NaN first, so every element must be written.
"""

import pytest
import torch
from gemm_cases import DEV, check_close, dense_problem

from gptoss_fp8.kernels import arrival_counters
from gptoss_fp8.kernels.fp8_gemm import fp8_gemm_reference
from gptoss_fp8.kernels.fp8_gemv import SkinnyTile, fp8_gemm_skinny, skinny_tile
from gptoss_fp8.quant.fp8 import cdiv


def _run(m, n, k, seed, bias=torch.bfloat16, out_dtype=torch.bfloat16, tile=None):
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(m, n, k, seed, bias)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
    y = fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, out, tile=tile)
    assert y is out
    check_close(out, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, torch.float32))
    return out


# Through the interpreter on CPU: N off the 128 grid (partial tiles, a partial 64-row scale block),
# K = 160 (a half K block) and 2880 (22.5 blocks), every tile width, splits of one block each, uneven
# splits (23 blocks / 4, / 5, / 3), splits beyond the block count (clamped), M tails of every row
# tile size, more than 64 rows (two row tiles), bias bf16 / fp32 / none, bf16 and fp32 out, TMA.
CASES = [
    # m, n, k, bias, out dtype, tile
    (1, 320, 2880, torch.bfloat16, torch.bfloat16, SkinnyTile(64, 4)),
    (1, 200, 160, None, torch.float32, SkinnyTile(16, 1)),
    (3, 200, 160, torch.float32, torch.float32, SkinnyTile(32, 2)),
    (3, 136, 2880, torch.float32, torch.bfloat16, SkinnyTile(128, 5)),
    (16, 200, 2880, None, torch.bfloat16, SkinnyTile(16, 3)),
    (33, 320, 288, torch.bfloat16, torch.float32, SkinnyTile(64, 1)),
    (64, 136, 2880, torch.bfloat16, torch.bfloat16, SkinnyTile(32, 4)),
    (5, 200, 2880, torch.bfloat16, torch.bfloat16, SkinnyTile(64, 3, tma=True)),
    (2, 64, 160, torch.bfloat16, torch.bfloat16, SkinnyTile(64, 8)),
    (130, 96, 288, torch.float32, torch.float32, SkinnyTile(32, 2)),
]


@pytest.mark.parametrize(
    "m,n,k,bias,out_dtype,tile", CASES, ids=[f"m{c[0]}-n{c[1]}-k{c[2]}-bn{c[5].block_n}-s{c[5].split_k}" for c in CASES]
)
def test_skinny_small(m, n, k, bias, out_dtype, tile):
    _run(m, n, k, seed=m * 7 + n + k, bias=bias, out_dtype=out_dtype, tile=tile)


def test_skinny_default_tile():
    """tile=None: skinny_tile's launch (split-K on the interpreter's 4 "SMs" at K = 2880)."""
    assert skinny_tile(8, 320, 2880, 4).split_k > 1
    _run(8, 320, 2880, seed=3)


def test_skinny_deterministic_and_counters_zeroed():
    """Two split-K calls are bit-identical (the last split sums the partials in split order), and
    every tile's arrival counter is back at 0 afterwards (the next launch relies on it)."""
    m, n, k = 4, 200, 2880
    tile = SkinnyTile(32, 5)
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(m, n, k, seed=21)
    tiles = cdiv(n, tile.block_n)
    counters = arrival_counters(torch.device(DEV), tiles)
    assert not counters.any(), "counters must start zeroed"
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEV)
        outs.append(fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, out, tile=tile))
        assert not arrival_counters(torch.device(DEV), tiles).any(), "arrival counters left non-zero"
    assert torch.equal(outs[0], outs[1])
    check_close(outs[0], fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, torch.float32))


def test_skinny_strided_rows():
    """x and x_scale with a row stride larger than their width (slices of wider buffers)."""
    m, n, k = 6, 136, 288
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(m, n, k, seed=8)
    xw = torch.zeros(m, k + 24, dtype=torch.uint8, device=DEV).view(x_fp8.dtype)  # 8-byte aligned rows
    xw[:, :k] = x_fp8
    sw = torch.zeros(m, x_scale.shape[1] + 3, dtype=torch.float32, device=DEV)
    sw[:, : x_scale.shape[1]] = x_scale
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    fp8_gemm_skinny(xw[:, :k], sw[:, : x_scale.shape[1]], w_fp8, w_scale, b, out, tile=SkinnyTile(32, 2))
    check_close(out, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, torch.float32))


def test_skinny_tile_heuristic():
    """The H200 launches the module docstring names, and the heuristic's invariants on the
    decode shapes (qkv, o_proj, 5760 x 2880, TP shards): every split >= 3 K blocks (or one split),
    at most 3 programs per SM, partials' traffic <= half the weight's."""
    assert skinny_tile(1, 5120, 2880, 132) == SkinnyTile(64, 4)
    assert skinny_tile(1, 2880, 4096, 132) == SkinnyTile(64, 8)
    for m in (1, 4, 16, 33, 64):
        for n, k in [(5120, 2880), (2880, 4096), (5760, 2880), (2560, 2880), (1280, 2048), (640, 2880), (200, 160)]:
            t = skinny_tile(m, n, k, 132)
            kb = cdiv(k, 128)
            programs = cdiv(n, t.block_n) * t.split_k
            assert t.block_n in (32, 64) and t.split_k >= 1, t
            assert t.split_k == 1 or (kb // t.split_k >= 3 and programs <= 3 * 132), (m, n, k, t)
            assert t.split_k == 1 or 16 * t.split_k * m <= k, (m, n, k, t)


def test_skinny_rejects_bad_inputs():
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(4, 64, 160, seed=1)
    out = torch.empty(4, 64, dtype=torch.bfloat16, device=DEV)
    bad = [
        dict(x_scale=x_scale[:, :1]),  # scale grid of a different K
        dict(w_scale=w_scale[:, :1]),
        dict(x_scale=x_scale.double()),
        dict(x_fp8=x_fp8.float()),  # not fp8
        dict(x_fp8=x_fp8[:, :150], x_scale=x_scale),  # K % 16 != 0 and K mismatch
        dict(x_fp8=x_fp8[None]),  # 3-D activations: the caller reshapes
        dict(b=b[:10]),
        dict(b=b.half()),
        dict(out=out.half()),
        dict(out=out[:2]),
        dict(out=torch.empty(64, 4, dtype=torch.bfloat16, device=DEV).t()),  # not contiguous
        dict(x_fp8=x_fp8.t().contiguous().t()),  # last dim not contiguous
        dict(tile=SkinnyTile(48, 2)),  # straddles a weight-scale block
        dict(tile=SkinnyTile(64, 0)),
    ]
    for case in bad:
        args = dict(x_fp8=x_fp8, x_scale=x_scale, w_fp8=w_fp8, w_scale=w_scale, b=b, out=out, tile=None) | case
        with pytest.raises(AssertionError):
            fp8_gemm_skinny(args["x_fp8"], args["x_scale"], args["w_fp8"], args["w_scale"], args["b"], args["out"], args["tile"])


# gpt-oss decode shapes on the GPU: qkv 5120x2880, o_proj 2880x4096, 5760x2880, TP shards
# (2560 / 1280 / 640 x 2880, 2880 x 2048); M from 1 to 64 and one past.
GPU_CASES = [
    (m, n, k) for n, k in [(5120, 2880), (2880, 4096), (5760, 2880), (2560, 2880), (640, 2880), (2880, 2048)] for m in (1, 8, 64)
] + [(65, 5120, 2880), (37, 1280, 2880)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_CASES)
def test_skinny_gpu(m, n, k):
    _run(m, n, k, seed=m + n + k)


GPU_VARIANTS = [
    SkinnyTile(16, 16, num_warps=4, num_stages=3),
    SkinnyTile(32, 8, num_warps=4, num_stages=6),
    SkinnyTile(64, 1, num_warps=4, num_stages=4),
    SkinnyTile(64, 7, num_warps=8, num_stages=4, tma=True),
    SkinnyTile(128, 4, num_warps=8, num_stages=3),
    SkinnyTile(128, 2, num_warps=4, num_stages=4, tma=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tile", GPU_VARIANTS, ids=lambda t: f"bn{t.block_n}-s{t.split_k}-w{t.num_warps}-st{t.num_stages}-tma{int(t.tma)}"
)
@pytest.mark.parametrize("m,out_dtype", [(1, torch.bfloat16), (16, torch.float32), (64, torch.bfloat16)])
def test_skinny_variants_gpu(m, out_dtype, tile):
    _run(m, 5120, 2880, seed=m + tile.block_n, out_dtype=out_dtype, tile=tile)


@pytest.mark.gpu
def test_skinny_deterministic_gpu():
    """Many splits racing on the GPU: ten calls, bit-identical."""
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(8, 2880, 4096, seed=5)
    outs = [torch.empty(8, 2880, dtype=torch.float32, device=DEV) for _ in range(10)]
    for out in outs:
        fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, out, tile=SkinnyTile(64, 16))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert not arrival_counters(torch.device(DEV), 45).any()


@pytest.mark.gpu
def test_skinny_cuda_graph():
    """Captured once, replayed on new activations: the same result as an eager call (workspace from
    the graph's pool, counters reset inside the kernel)."""
    m, n, k = 4, 5120, 2880
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(m, n, k, seed=9)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, out)
    x2, s2, _, _, _ = dense_problem(m, n, k, seed=10)
    x_fp8.copy_(x2)
    x_scale.copy_(s2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_close(out, fp8_gemm_reference(x_fp8, x_scale, w_fp8, w_scale, b, torch.float32))
    eager = torch.empty_like(out)
    fp8_gemm_skinny(x_fp8, x_scale, w_fp8, w_scale, b, eager)
    assert torch.equal(out, eager)

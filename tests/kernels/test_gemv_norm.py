"""The skinny GEMM with the residual add + RMSNorm + FP8 quantization fused into its epilogue
(kernels/fp8_gemv.py ``fp8_gemm_skinny_add_rms_norm``), an experiment not wired into the model.

(a) Its five outputs (delta, xo, y, q, s) equal the unfused pair's, ``fp8_gemm_skinny`` with the
    same tile then ``norm.rms_norm_quant`` on its output, bit for bit: the GEMM is the same code,
    the norm is the same helper (norm.py ``add_rms_norm_rows``) on the same tile. On the GPU that
    needs the norm's warp count too (the sum of squares' order is the layout's), which the default
    tile takes; the interpreter's order does not depend on it.
(b) Against the plain-torch references, stage by stage on the kernel's own intermediates:
    delta vs ``block_gemm_reference`` in fp32 with test_fp8_gemv's tolerances (gemm_cases.py),
    xo vs ``spec.add_rms_norm`` and y vs ``spec.rms_norm`` of xo with test_norm's (one bf16 ulp,
    two on CPU), (q, s) vs ``act_quant_reference`` of y with test_act_quant's (CPU exact; GPU
    scales within an fp32 ulp, FP8 values at most one e4m3 step away, at most 1e-4 of them) and
    bit for bit vs ``act_quant`` (the kernel) of y, as test_norm checks rms_norm_quant.
(c) Two calls give the same bits and leave every arrival counter at 0 (graph replays rely on it).
(d) The same on the GPU at the 20b o_proj shape, eagerly, with PDL and as replayed CUDA graphs.
And an sm_90 compile check (CPU): the fused kernel at the 20b o_proj launch has no spills, still
runs wgmma, reduces the norm's sums in rms_norm_quant's layouts at 8 warps and, launched with PDL,
waits before any store or atomic (its L2 prefetches before the wait).
Inputs: fresh random activations / weights (gemm_cases.dense_problem), residual and norm weight.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from gemm_cases import DEV, check_close, dense_problem
from test_norm import _check as check_norm

from gptoss_fp8.kernels import arrival_counters, sm_count
from gptoss_fp8.kernels.act_quant import act_quant, act_quant_reference
from gptoss_fp8.kernels.fp8_gemv import SkinnyTile, fp8_gemm_skinny, fp8_gemm_skinny_add_rms_norm, skinny_tile
from gptoss_fp8.kernels.norm import norm_tile, rms_norm_quant
from gptoss_fp8.quant.fp8 import block_gemm_reference
from gptoss_fp8.spec import add_rms_norm as add_rms_norm_reference
from gptoss_fp8.spec import rms_norm as rms_norm_reference

EPS = 1e-5
NAMES = ("delta", "xo", "y", "q", "s")


def _problem(m, n, k, seed):
    x_fp8, x_scale, w_fp8, w_scale, b = dense_problem(m, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    resid = (torch.randn(m, n, generator=g) * 2).to(DEV, torch.bfloat16)
    nw = (torch.rand(n, generator=g) + 0.5).to(DEV)
    return (x_fp8, x_scale, w_fp8, w_scale, b), resid, nw


def _fused(gemm, resid, nw, tile, pdl=False):
    return fp8_gemm_skinny_add_rms_norm(*gemm, resid, nw, EPS, tile=tile, pdl=pdl)


def _unfused(gemm, resid, nw, tile, pdl=False):
    delta = torch.full(resid.shape, float("nan"), dtype=torch.bfloat16, device=resid.device)
    fp8_gemm_skinny(*gemm, delta, tile=tile, pdl=pdl)
    xo, y, (q, s) = rms_norm_quant(resid, delta, nw, EPS, pdl=pdl)
    return delta, xo, y, q, s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(got, want, what=""):
    for name, a, b in zip(NAMES[: len(got)], got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape, a.dtype, b.dtype)
        same = _bits(a) == _bits(b)
        assert bool(same.all()), f"{what} {name}: {int((~same).sum())} of {a.numel()} elements differ"


def _check_quant(q, s, y):
    """(q, s) against act_quant_reference(y) with test_act_quant's tolerances, and bit for bit
    against the act_quant kernel on y."""
    qk, sk = act_quant(y)
    assert torch.equal(s, sk) and torch.equal(_bits(q), _bits(qk))
    qr, sr = act_quant_reference(y)
    if DEV == "cpu":
        assert torch.equal(s, sr) and torch.equal(_bits(q), _bits(qr))
        return
    assert bool(((s - sr).abs() <= torch.finfo(torch.float32).eps * sr.abs()).all())

    def ordinal(t):
        b = t.view(torch.uint8).to(torch.int16)
        return torch.where(b >= 128, -(b - 128), b)

    step = (ordinal(q) - ordinal(qr)).abs()
    assert int(step.max()) <= 1 and int((step > 0).sum()) <= max(1e-4 * q.numel(), 2)


def _check_reference(gemm, resid, nw, out):
    delta, xo, y, q, s = out
    check_close(delta, block_gemm_reference(*gemm, torch.float32))
    xr, _ = add_rms_norm_reference(resid, delta, nw, EPS)
    check_norm(xo, xr, scale=delta)
    check_norm(y, rms_norm_reference(xo, nw, EPS))
    _check_quant(q, s, y)
    assert q.float().abs().max() > 100  # a group's largest value lands near 448


# Through the interpreter. N = 2880 (the gpt-oss hidden size: BLOCK_H 4096, one row per norm step,
# a half last group) and small N off the 128 grid (partial GEMM tiles and a partial group; several
# rows per norm step); K = 4096 / 2880 (22.5 K blocks) / small; split-K 1 (the tile arrives itself)
# and several (even, uneven, clamped to the K block count); M 1 / 3 / 16, 33 (a 64-row tile, norm
# steps of 8 rows) and 70 (two row blocks, two norm counters).
CASES = [
    # m, n, k, tile
    (1, 2880, 4096, SkinnyTile(64, 8)),
    (3, 2880, 2880, SkinnyTile(64, 1)),
    (16, 2880, 2880, SkinnyTile(128, 5)),
    (1, 320, 2880, SkinnyTile(64, 4)),
    (3, 320, 4096, SkinnyTile(32, 1)),
    (16, 320, 2880, SkinnyTile(64, 3)),
    (33, 200, 288, SkinnyTile(64, 2)),
    (70, 136, 160, SkinnyTile(16, 9)),
]
IDS = [f"m{m}-n{n}-k{k}-bn{t.block_n}-s{t.split_k}" for m, n, k, t in CASES]
# The first three under -m slow, ~15 s each in the interpreter: N 2880 (the third, 16 rows at BLOCK_N 128
# and split 5, was the default run's; its M, K and a split-K tile run by default at N 320 in the sixth:
# m16-n320-k2880-bn64-s3) and K 4096 / split 1 (also at N 320 by default)
SLOW_CASES = (0, 1, 2)
PARAMS = [pytest.param(i, id=IDS[i], marks=[pytest.mark.slow] if i in SLOW_CASES else []) for i in range(len(CASES))]


@functools.cache
def _run_case(i):
    m, n, k, tile = CASES[i]
    gemm, resid, nw = _problem(m, n, k, seed=m * 13 + n + k)
    return gemm, resid, nw, _fused(gemm, resid, nw, tile), _unfused(gemm, resid, nw, tile)


@pytest.mark.parametrize("i", PARAMS)
def test_fused_equals_the_unfused_pair(i):
    _, resid, _, fused, unfused = _run_case(i)
    _assert_same(fused, unfused, IDS[i])
    assert not torch.equal(fused[1], resid)  # the delta was added


@pytest.mark.parametrize("i", PARAMS)
def test_fused_matches_the_references(i):
    gemm, resid, nw, fused, _ = _run_case(i)
    _check_reference(gemm, resid, nw, fused)


def test_fused_default_tile_and_repeat_calls():
    """tile=None (skinny_tile's split on the interpreter's 4 "SMs", norm.py's warps) and two calls
    in a row: the same bits, every arrival counter back at 0."""
    m, n, k = 4, 320, 2880
    assert skinny_tile(m, n, k, 4).split_k > 1
    gemm, resid, nw = _problem(m, n, k, seed=5)
    counters = arrival_counters(torch.device(DEV), 64)
    assert not counters.any(), "counters must start zeroed"
    outs = []
    for _ in range(2):
        outs.append(_fused(gemm, resid, nw, None))
        assert not arrival_counters(torch.device(DEV), 64).any(), "arrival counters left non-zero"
    _assert_same(outs[0], outs[1], "second call")
    _check_reference(gemm, resid, nw, outs[0])


def test_fused_rejects_bad_inputs():
    gemm, resid, nw = _problem(2, 320, 288, seed=2)
    bad = [
        dict(resid=resid[:, :256]),  # N is not the residual's width
        dict(resid=resid[:1]),  # rows
        dict(resid=resid.float()),
        dict(nw=nw[:100]),
        dict(nw=nw.to(torch.bfloat16)),
    ]
    for case in bad:
        args = dict(resid=resid, nw=nw) | case
        with pytest.raises(AssertionError):
            _fused(gemm, args["resid"], args["nw"], SkinnyTile(64, 2))
    empty = _fused(tuple(t[:0] if i < 2 else t for i, t in enumerate(gemm)), resid[:0], nw, None)
    assert [t.shape[0] for t in empty] == [0] * 5


# ---------------------------------------------------------------------------------------------
# GPU: the 20b o_proj (2880 x 4096) at decode row counts

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8, 64])
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_equals_the_unfused_pair_gpu(m, pdl):
    """The default tile (norm.py's warps): bit for bit the unfused pair with the same tile, eager
    and as a CUDA graph replayed twice on new activations; counters zeroed after each."""
    n, k = 2880, 4096
    gemm, resid, nw = _problem(m, n, k, seed=m + 100)
    tile = replace(skinny_tile(m, n, k, sm_count(torch.device(DEV))), num_warps=norm_tile(n, True)[2])
    fused = _fused(gemm, resid, nw, None, pdl)
    _assert_same(fused, _unfused(gemm, resid, nw, tile, pdl), f"m={m}")
    _check_reference(gemm, resid, nw, fused)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fused(gemm, resid, nw, None, pdl)
    for seed in (7, 8):
        (x2, s2, *_), r2, _ = _problem(m, n, k, seed=seed)
        gemm[0].copy_(x2)
        gemm[1].copy_(s2)
        resid.copy_(r2)
        for t in captured:
            t.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        assert not arrival_counters(torch.device(DEV), 64).any()
        _assert_same(captured, _unfused(gemm, resid, nw, tile, pdl), f"m={m} replay seed {seed}")


@pytest.mark.gpu
def test_fused_four_warps_gpu():
    """With the GEMM's own 4 warps (not the norm's 8 at H = 2880): delta and xo still bit for bit,
    y / q / s within the references' tolerances; ten calls give the same bits."""
    m, n, k = 8, 2880, 4096
    gemm, resid, nw = _problem(m, n, k, seed=11)
    tile = SkinnyTile(64, 8, num_warps=4)
    outs = [_fused(gemm, resid, nw, tile) for _ in range(10)]
    for o in outs[1:]:
        _assert_same(o, outs[0], "repeat")
    unfused = _unfused(gemm, resid, nw, tile)
    _assert_same(outs[0][:2], unfused[:2], "delta / xo")
    _check_reference(gemm, resid, nw, outs[0])


# ---------------------------------------------------------------------------------------------
# sm_90 compile (Triton's compiler and ptxas, no GPU): the fused kernel at the 20b o_proj launch

_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gptoss_fp8.kernels import fp8_gemv, norm
from gptoss_fp8.kernels._gluon import _as_launched, ptxas_resources


def reduce_layouts(ttgir):  # the resolved layouts of every tt.reduce operand (fused: the norm's sums / maxima)
    alias = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    ops = re.findall(r"\}\) : \(tensor<([^,]+), (#\w+)>\)", ttgir)
    return [(shape, alias.get(lay, lay)) for shape, lay in ops]

fn = fp8_gemv._fp8_gemv_norm_kernel
BF, F32, I32, F8 = "*bf16", "*fp32", "*i32", "*fp8e4nv"
PTRS = dict(x_ptr=F8, xs_ptr=F32, w_src=F8, ws_ptr=F32, bias_ptr=BF, out_ptr=BF, part_ptr=F32, counter_ptr=I32,
            resid_ptr=BF, nw_ptr=F32, xo_ptr=BF, y_ptr=BF, q_ptr=F8, s_ptr=F32, eps="fp32")
DIV16 = [a for a in PTRS if a not in ("eps",)] + ["N", "K", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn", "stride_r"]
# rms_norm_quant's launch at H = 2880 (norm_tile: BLOCK_M 1, BLOCK_H 4096, 8 warps)
NP = dict(x_ptr=BF, d_ptr=BF, w_ptr=F32, xo_ptr=BF, y_ptr=BF, q_ptr=F8, s_ptr=F32, cw_ptr=BF, eps="fp32")
nf = norm._rms_norm_kernel
nc = dict(HAS_DELTA=True, BLOCK_M=1, BLOCK_H=4096, QUANT=True, GROUP=128, FP8_MAX_C=448.0, EPS=1e-10, TOP_K=0,
          PDL=True, M=1)
# (as a launch specializes it: the constexprs left out at their defaults)
nsig, nc, nattrs = _as_launched(nf, NP, nc, tuple(a for a in nf.arg_names
                                                   if a.endswith("_ptr") or a.startswith("stride") or a == "H"))
nk = triton.compile(ASTSource(nf, nsig, nc, nattrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
norm_layouts = reduce_layouts(nk.asm["ttgir"])
res = {}
# the 20b o_proj (N 2880, K 4096) at M = 1 (a launch specializes M = 1) and M = 8, split 8, norm.py's
# tile for H = 2880 (BLOCK_H 4096, one row a step) with its 8 warps and the GEMM's own 4
for name, warps, m1, pdl in (("w8_m1_pdl", 8, True, True), ("w8_m8", 8, False, False), ("w4_m1_pdl", 4, True, True),
                             ("w8_s1_m1_pdl", 8, True, True)):
    split = 1 if "_s1_" in name else 8
    consts = dict(HAS_BIAS=True, TMA=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split,
                  RED_CHUNK=fp8_gemv.red_chunk(split, warps), NORM_ROWS=1, BLOCK_H=4096, PDL=pdl,
                  PF_STEPS=triton.next_power_of_2(2 * (32 // split)) if pdl else 0)
    if m1:
        consts["M"] = 1
    sig = {a: "constexpr" if a in consts else PTRS.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in DIV16}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=4))
    ptx = k.asm["ptx"]
    first = lambda pat: min([m.start() for m in re.finditer(pat, ptx)], default=-1)
    res[name] = dict(ptxas_resources(ptx), wait=first(r"griddepcontrol\.wait"), pdl=pdl,
                     prefetch=first(r"prefetch\.global\.L2"),
                     store=first(r"\bst\.global|\batom\.|\bred\.|cp\.async\.bulk\.global"),
                     atoms=len(re.findall(r"\batom\.", ptx)), cg_loads=len(re.findall(r"ld\.global\.cg", ptx)),
                     wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                     norm_layouts=reduce_layouts(k.asm["ttgir"]) == norm_layouts and len(norm_layouts) == 2)
print(json.dumps(res))
"""


@pytest.mark.slow  # the fused kernel is an experiment, not in the model
def test_fused_kernel_compiles_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    for name, k in res.items():
        assert "ptxas_error" not in k, (name, k.get("ptxas_error"))
        if "regs" in k:  # (no report where triton's ptxas is missing)
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] == 0, (name, k)
        assert k["wgmma"] > 0, (name, k)  # the GEMM still on wgmma
        assert k["cg_loads"] > 0, (name, k)  # the delta (and partials) read back through L2
        assert k["atoms"] == (1 if "_s1_" in name else 2), (name, k)  # split-K count (if split), row count
        if k["pdl"]:
            assert 0 <= k["wait"] < k["store"], (name, k)  # nothing written before the predecessor is done
            assert 0 <= k["prefetch"] < k["wait"], (name, k)  # weights (and the norm's inputs) hinted before it
        # with the norm's 8 warps, its sums reduce in rms_norm_quant's layouts (hence order): same bits
        assert k["norm_layouts"] == name.startswith("w8"), (name, k)

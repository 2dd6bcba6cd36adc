"""act_quant (Triton) against quant/fp8.quantize_act.

Tolerances: through the interpreter (CPU), exact: identical scales and FP8 values (there the kernel
rounds to e4m3 with integer arithmetic before the cast, so the interpreter's own faulty fp32 -> fp8
cast never rounds; on the GPU the hardware cast rounds, to the same values: test_e4m3_cast_gpu). On
the GPU, Triton's fp32 division is not IEEE-rounded (and torch's CUDA division by a scalar is a
multiplication by its reciprocal), so: scales within 1 fp32 ulp, and at most 1e-4 of the FP8 values
(two on small tensors) one e4m3 step away from torch's, none further.
"""

import pytest
import torch
import triton
import triton.language as tl

from gptoss_fp8.kernels.act_quant import act_quant, act_quant_reference, e4m3, e4m3_saturated, round_to_e4m3

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    # Magnitudes over 12 decades along K, so groups hit fp8 normals, subnormals and saturation.
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, k)
    x = x.to(dtype)
    x.view(-1, k)[0, :4] = torch.tensor([1e-12, -3e-8, 0.0, 448.0], dtype=dtype)  # tiny, zero-ish, exact max
    return x.to(DEV)


def _check(x):
    q, s = act_quant(x)
    q_ref, s_ref = act_quant_reference(x)
    assert q.shape == x.shape and s.shape == s_ref.shape
    if x.device.type == "cpu":
        assert torch.equal(s, s_ref), f"scales differ at {int((s != s_ref).sum())} places"
        diff = q.float() != q_ref.float()
        assert int(diff.sum()) == 0, f"{int(diff.sum())} of {q.numel()} fp8 values differ"
        return
    ulp = torch.finfo(torch.float32).eps * s_ref.abs()
    assert bool(((s - s_ref).abs() <= ulp).all()), f"scales differ by more than 1 ulp: {(s - s_ref).abs().max().item()}"
    # One e4m3 step at most: compare the fp8 values' ordinal positions (bit patterns of |q|, signed).
    def ordinal(t):
        b = t.view(torch.uint8).to(torch.int16)
        return torch.where(b >= 128, -(b - 128), b)
    step = (ordinal(q) - ordinal(q_ref)).abs()
    assert int(step.max()) <= 1, f"fp8 values differ by {int(step.max())} steps"
    flips = int((step > 0).sum())
    # a rate bound (1e-4 of the values; measured ~6e-5 at 8192 x 2880), which on a tensor of a few
    # thousand values still allows one or two flips (measured: 1 of 1024, 1 of 1728)
    assert flips <= max(1e-4 * q.numel(), 2), f"{flips} of {q.numel()} fp8 values differ by one step"


@pytest.mark.parametrize("shape", [(37, 2880), (5, 160), (3, 64), (2, 3, 288)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_small(shape, dtype):
    _check(_inputs(shape, dtype, seed=hash((shape, str(dtype))) % 1000))


def test_act_quant_zero_group():
    # An all-zero group takes the eps scale and quantizes to zeros (the one place zeros are right).
    x = _inputs((4, 256), torch.bfloat16, seed=3)
    x[1, 128:] = 0
    _check(x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 2880), (1, 2880), (4099, 4096), (131072, 160)])
def test_act_quant_gpu(shape):
    _check(_inputs(shape, torch.bfloat16, seed=shape[0]))


@triton.jit
def _both_roundings(x_ptr, hw_ptr, sw_ptr, sat_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    raw = tl.load(x_ptr + i, mask=i < n, other=0.0)
    x = tl.minimum(tl.maximum(raw, -448.0), 448.0)
    tl.store(hw_ptr + i, e4m3(x).to(tl.float8e4nv), mask=i < n)
    tl.store(sw_ptr + i, round_to_e4m3(x), mask=i < n)
    tl.store(sat_ptr + i, e4m3_saturated(raw, 448.0).to(tl.float8e4nv), mask=i < n)  # (no clamp on the GPU)


def _e4m3_sweep() -> torch.Tensor:
    """fp32 values over e4m3's range: every finite e4m3 value, every midpoint between neighbours (the ties) and
    one fp32 ulp either side of each, both signs; random values over 22 binades (normals, subnormals, beyond 448)."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)].unique()  # ascending, -448 .. 448
    mid = (v[1:] + v[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, torch.tensor(float("inf"))), torch.nextafter(mid, torch.tensor(-float("inf")))])
    g = torch.Generator().manual_seed(34)
    rnd = torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-14, 10, (1 << 20,), generator=g).float())
    return torch.cat([v, near, rnd, torch.tensor([500.0, -1e6, 1e-30, -1e-30, 0.0, -0.0, 448.5, 463.9, 464.0,
                                                   -470.0, float("inf"), -float("inf")])])


@pytest.mark.gpu
def test_e4m3_cast_gpu():
    """``e4m3`` on the GPU (the hardware cast, cvt.rn.satfinite) rounds every value of the sweep as torch's cast of
    the clamped value does, bytes and all (a negative rounding to zero gives -0, 0x80), and as ``round_to_e4m3``
    (the interpreter's rounding, integer arithmetic) does, values equal (its zeros are +0): the two ways the
    quantizing kernels round (act_quant, the norm, attn_quant, the MoE's) agree. And ``e4m3_saturated`` of the
    values unclamped (the cast saturating by itself, values past 448 and infinities included) gives the same bytes
    as the cast of the clamped values."""
    x = _e4m3_sweep().cuda()
    hw = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    sat = torch.empty_like(hw)
    sw = torch.empty_like(x)
    _both_roundings[(triton.cdiv(x.numel(), 1024),)](x, hw, sw, sat, x.numel(), BLOCK=1024)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(hw.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(sat.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(sw, want.float())  # (+0 == -0)
    assert (want.view(torch.uint8) == 0x80).any() and (want.float().abs() == 448).any()  # the sweep reaches both

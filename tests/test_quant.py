"""quant/ codecs against plain references, on fresh random inputs.

Tolerances: the MXFP4 decode and the direct MXFP4 -> FP8 path are bit-exact (equality of bytes);
FP8 rounding is checked against e4m3's half-ulp bound (relative 2^-4 for normals).
"""

import math

import pytest
import torch

from gptoss_fp8.quant.fp8 import (
    FP8_MAX,
    dequantize_act,
    dequantize_weight_blocks,
    pow2_scale_for_amax,
    quantize_act,
    quantize_weight_blocks,
)
from gptoss_fp8.quant.mxfp4 import decode_mxfp4, mxfp4_to_fp8, nan_scale_count


def _rand_mxfp4(shape, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi + 1, shape, generator=g).to(torch.uint8)
    return blocks, scales


def test_decode_bit_identical_to_openai_checkpoint(tmp_path):
    weights = pytest.importorskip("gpt_oss.torch.weights")
    from safetensors.torch import save_file

    blocks, scales = _rand_mxfp4((3, 70, 5), 0, 254, seed=1)  # the whole e8m0 range but NaN
    blocks2, scales2 = _rand_mxfp4((2, 33, 3), 110, 135, seed=2)
    save_file({"block.0.mlp.mlp1_weight.blocks": blocks, "block.0.mlp.mlp1_weight.scales": scales,
               "block.1.mlp.mlp2_weight.blocks": blocks2, "block.1.mlp.mlp2_weight.scales": scales2},
              str(tmp_path / "model.safetensors"))
    ck = weights.Checkpoint(str(tmp_path), torch.device("cpu"))
    for name, b, s in (("block.0.mlp.mlp1_weight", blocks, scales), ("block.1.mlp.mlp2_weight", blocks2, scales2)):
        theirs = ck.get(name)
        ours = decode_mxfp4(b, s).reshape(theirs.shape)
        assert theirs.dtype == ours.dtype == torch.bfloat16
        assert torch.equal(theirs.view(torch.int16), ours.view(torch.int16)), name


@pytest.mark.parametrize("shape,lo,hi", [
    ((2, 300, 5), 100, 140),  # wide spread: many groups lose bits
    ((1, 257, 90), 115, 126),  # gpt-oss-like spread, N not a multiple of 128
    ((64, 1), 0, 252),  # extremes (253+ overflow fp32 in the float reference itself), 2-D
    ((3, 130, 7), 120, 124),
])
def test_direct_path_equals_decode_then_quantize(shape, lo, hi):
    blocks, scales = _rand_mxfp4(shape, lo, hi, seed=sum(shape) + lo)
    # sprinkle all-zero groups with random (even huge) scales: they must not affect the block scale
    blocks.view(-1, 16)[::7] = 0
    q, s, st = mxfp4_to_fp8(blocks, scales)
    ref = decode_mxfp4(blocks, scales, torch.float32)
    assert torch.isfinite(ref).all()
    q_ref, s_ref = quantize_weight_blocks(ref, "pow2")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    back = dequantize_weight_blocks(q, s, torch.float64)
    exact = int((back == ref.double()).sum())
    assert st.exact == exact and st.total == ref.numel()


def test_direct_path_with_extreme_scales_is_exact_where_representable():
    blocks, scales = _rand_mxfp4((130, 9), 0, 254, seed=5)
    q, s, st = mxfp4_to_fp8(blocks, scales)
    assert torch.isfinite(s).all() and torch.isfinite(q.float()).all()
    # values of the block maximum's group are always exact
    assert st.exact > 0 and 0 < st.exact_fraction < 1


def test_pow2_mode_lossless_for_gpt_oss_like_exponents():
    blocks, scales = _rand_mxfp4((4, 200, 12), 116, 126, seed=3)  # 10 binades of spread
    q, s, st = mxfp4_to_fp8(blocks, scales)
    assert st.exact_fraction == 1.0 and st.max_rel_err == 0.0
    ref = decode_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dequantize_weight_blocks(q, s), ref)
    # amax/448 rounds a large part of the same values
    qa, sa = quantize_weight_blocks(ref, "amax")
    frac = (dequantize_weight_blocks(qa, sa) == ref).float().mean().item()
    assert frac < 0.9


def test_nan_scale_detection():
    _, scales = _rand_mxfp4((5, 4), 100, 130, seed=4)
    assert nan_scale_count(scales) == 0
    scales[2, 1] = 255
    assert nan_scale_count(scales) == 1


@pytest.mark.parametrize("shape", [(300, 200), (3, 129, 2880 // 10), (1, 1), (256, 128)])
@pytest.mark.parametrize("mode", ["pow2", "amax"])
def test_block_quantization_bounds(shape, mode):
    g = torch.Generator().manual_seed(hash((shape, mode)) % 1000)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])  # wide dynamic range along K
    q, s = quantize_weight_blocks(w, mode)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    back = dequantize_weight_blocks(q, s)
    # each element: |err| <= half an e4m3 ulp at its magnitude, or the subnormal step of its block
    blockstep = torch.repeat_interleave(torch.repeat_interleave(s, 128, -2)[..., : shape[-2], :], 128, -1)[..., : shape[-1]]
    bound = torch.maximum(w.abs() * 2.0**-4, blockstep * 2.0**-10)
    assert ((back - w).abs() <= bound * 1.0001).all()
    amax = (w.abs().amax())
    assert (q.float().abs() <= FP8_MAX).all()
    if mode == "amax":
        # the block holding the global max uses the full range
        assert back.abs().max() <= amax * (1 + 2.0**-4)


def test_no_nan_or_inf_from_finite_extremes():
    w = torch.tensor([[3.0e38, -3.0e38, 1e-40, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w = torch.cat([w, torch.zeros(200, 4)])  # one block with extremes, a zero block below
    for mode in ("pow2", "amax"):
        q, s = quantize_weight_blocks(w, mode)
        assert torch.isfinite(q.float()).all() and torch.isfinite(s).all() and (s > 0).all()
        back = dequantize_weight_blocks(q, s)
        assert torch.isfinite(back).all()
        assert back[0, 0] == pytest.approx(3.0e38, rel=0.07)
    z, sz = quantize_weight_blocks(torch.zeros(5, 5))
    assert (sz == 1.0).all() and (z.float() == 0).all()


def test_pow2_scale_is_smallest_power_of_two_that_fits():
    g = torch.Generator().manual_seed(7)
    amax = torch.exp(torch.randn(10000, generator=g) * 20).clamp(max=3e38)
    s = pow2_scale_for_amax(amax)
    m, _ = torch.frexp(s)
    assert (m == 0.5).all()  # powers of two
    assert (amax / s <= FP8_MAX).all() and (amax / (s / 2) > FP8_MAX).all()


@pytest.mark.parametrize("k", [2880, 160, 128, 7])
def test_activation_quantization(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=g, dtype=torch.float32) * torch.linspace(0.01, 50, k)
    q, s = quantize_act(x.to(torch.bfloat16))
    assert q.shape == x.shape and s.shape == (9, math.ceil(k / 128)) and s.dtype == torch.float32
    xb = x.to(torch.bfloat16).float()
    groups = torch.nn.functional.pad(xb, (0, s.shape[1] * 128 - k)).reshape(9, -1, 128)
    assert torch.equal(s, groups.abs().amax(-1) / FP8_MAX)
    back = dequantize_act(q, s)
    step = s.repeat_interleave(128, -1)[:, :k]
    assert ((back - xb).abs() <= torch.maximum(xb.abs() * 2.0**-4, step * 2.0**-10) * 1.0001).all()


@pytest.mark.parametrize("mode", ["pow2", "amax"])
@pytest.mark.parametrize("shape", [(1100, 300), (64, 2880), (513, 129)])
def test_banded_quantization_equals_one_shot(mode, shape):
    from gptoss_fp8.quant.fp8 import fp8_exact_fraction, quantize_weight_blocks_banded

    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[1])).to(torch.bfloat16)
    q, s, exact, max_rel = quantize_weight_blocks_banded(w, mode, rows=256, workers=2)
    q1, s1 = quantize_weight_blocks(w, mode)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    assert (exact, max_rel) == fp8_exact_fraction(dequantize_weight_blocks(q1, s1), w)
    assert 0 < exact < w.numel()


# ------------------------------------------------------------------------------------------------
# encode_mxfp4: float -> MXFP4 (the trained fixture's export), against a brute-force nearest search

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _random_groups(shape, seed):
    """Floats [..., K] whose 32-groups span many binades (a group's own scale), zeros sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    span = torch.randint(-30, 30, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    w = (w.reshape(*shape[:-1], -1, 32) * torch.exp2(span)).reshape(shape)
    w[torch.rand(shape, generator=g) < 0.05] = 0.0
    return w


def test_encode_mxfp4_nearest_value_under_the_smallest_scale_that_fits():
    from gptoss_fp8.quant.mxfp4 import encode_mxfp4

    seed = int(torch.randint(0, 10**6, (1,)))
    w = _random_groups((3, 40, 256), seed)
    blocks, scales = encode_mxfp4(w)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (3, 40, 8, 16) and scales.shape == (3, 40, 8)
    grp = w.reshape(3, 40, 8, 32).double()
    e = scales.long() - 127  # [3, 40, 8]
    amax = grp.abs().amax(-1)
    scale = torch.exp2(e.double())
    # the smallest power of two under which the group's largest value does not saturate (6 = e2m1's top)
    assert (amax <= 6 * scale).all(), seed
    assert (amax > 3 * scale).all(), seed  # 2^(e-1) would not do: amax > 6 * 2^(e-1)
    # each value is a nearest e2m1 value x scale (brute force over the 15 signed values)
    got = decode_mxfp4(blocks, scales, torch.float32).reshape(3, 40, 8, 32).double()
    cand = torch.cat([E2M1_GRID, -E2M1_GRID[1:]]).double()
    dist = (grp.unsqueeze(-1) - cand * scale[..., None, None]).abs()  # [..., 32, 15]
    assert torch.equal((grp - got).abs(), dist.amin(-1)), seed
    # and the sign survives, zeros included: a negative value never decodes positive
    assert not ((grp < 0) & (got > 0)).any() and not ((grp > 0) & (got < 0)).any()


def test_encode_mxfp4_ties_go_to_the_even_code():
    from gptoss_fp8.quant.mxfp4 import encode_mxfp4

    seed = int(torch.randint(0, 10**6, (1,)))
    g = torch.Generator().manual_seed(seed)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # codes 0, 2, 2, 4, 4, 6, 6
    rows = []
    for _ in range(16):
        e = int(torch.randint(-20, 20, (1,), generator=g))
        sign = torch.randint(0, 2, (7,), generator=g) * 2.0 - 1
        row = torch.cat([mids * sign, torch.tensor([6.0]), torch.zeros(24)])  # 6: the scale is 2^e
        rows.append((torch.ldexp(row, torch.tensor(e)), e, sign))
    w = torch.stack([r[0] for r in rows])
    blocks, scales = encode_mxfp4(w)
    got = decode_mxfp4(blocks, scales, torch.float32)
    for j, (_, e, sign) in enumerate(rows):
        assert int(scales[j, 0]) == e + 127
        assert torch.equal(got[j, :7], torch.ldexp(even * sign, torch.tensor(e))), (seed, j)


def test_encode_mxfp4_round_trips_mxfp4_values():
    from gptoss_fp8.quant.mxfp4 import encode_mxfp4

    seed = int(torch.randint(0, 10**6, (1,)))
    blocks, scales = _rand_mxfp4((2, 50, 6), 100, 150, seed)
    blocks[:, ::3] &= 0xBB  # a third of the rows: magnitude codes 0-3 only (largest value <= 1.5 x scale)
    blocks[:, 1::3] &= 0x99  # another third: codes 0-1 (+-0, +-0.5 x scale)
    # every group whose largest value is 4 or 6 x its scale (codes 6 / 7) encodes to the same bytes
    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1) & 0x7
    big = (codes >= 6).flatten(-2).any(-1)
    w = decode_mxfp4(blocks, scales, torch.float32)
    b2, s2 = encode_mxfp4(w)
    assert torch.equal(b2[big], blocks[big]) and torch.equal(s2[big], scales[big]), seed
    assert (~big).sum() > 100 and (s2[~big] < scales[~big]).any()  # the others got a smaller scale
    # any group's values come back exactly (another scale, the same numbers; -0 stays -0)
    back = decode_mxfp4(b2, s2, torch.float32)
    assert torch.equal(back.view(torch.int32), w.view(torch.int32)), seed


def test_encode_mxfp4_zero_group_and_layout():
    from gptoss_fp8.quant.mxfp4 import E2M1_VALUES, encode_mxfp4

    seed = int(torch.randint(0, 10**6, (1,)))
    g = torch.Generator().manual_seed(seed)
    # codes drawn at random, as values x 2^-3; the group's scale is pinned by a 6 (code 7) at element 31
    codes = torch.randint(0, 16, (5, 64), generator=g)
    codes[:, 31] = 7
    codes[:, 63] = 7
    w = torch.tensor(E2M1_VALUES)[codes] * 2.0**-3
    w[2, 32:] = 0.0  # row 2's second group: all zeros
    blocks, scales = encode_mxfp4(w)
    assert scales[2, 1] == 0 and (blocks[2, 1] == 0).all()  # scale 2^-127, +0 codes
    assert (decode_mxfp4(blocks, scales, torch.float32)[2, 32:] == 0).all()
    keep = torch.ones(5, 2, dtype=torch.bool)
    keep[2, 1] = False
    assert (scales[keep] == 127 - 3).all()
    # byte b of a group holds element 2b in its LOW nibble and element 2b + 1 in its HIGH nibble
    c = codes.reshape(5, 2, 16, 2)
    want = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    assert torch.equal(blocks[keep], want[keep]), seed
    with pytest.raises(AssertionError, match="multiple of 32"):
        encode_mxfp4(torch.ones(4, 48))

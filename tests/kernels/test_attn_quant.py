"""kernels/attn_quant.py (Triton) against quant/attn_fp8.py (and, for V's key_order layout, the
expected tensor built here with torch indexing).

Inputs: fresh random values, log-uniform magnitudes over 9 decades with per-head and per-channel
factors over 4 more and one x1000 outlier per head, so blocks hit e4m3 normals, subnormals, values
that round to +-0 and the saturation bound; bf16 and fp32; fp8_max 448 and 240; strided views of a
fused qkv buffer.
Tolerances: through the interpreter (CPU), exact: identical scales and identical e4m3 bytes (-0
included). On the GPU, against the reference run on the GPU, act_quant's tolerance: scales within 1
fp32 ulp (torch's CUDA division by the Python fp8_max is a multiplication by its reciprocal, the
kernel's a division), e4m3 values at most one step from the reference's, and at most 1e-4 of them
(two on small tensors) one step away (passed on an H200 with the kernels' div_rn; Triton's plain
``/`` exceeded it on the small tensors: 3 of 12800).
"""

import pytest
import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels import attn_quant
from gptoss_fp8.quant import attn_fp8
from gptoss_fp8.quant.fp8 import FP8_DTYPE, cdiv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _values(shape, seed):
    """fp32 [T, H, D] on DEV (see the module docstring)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    t, h, d = shape
    kw = dict(generator=g, device=DEV)
    x = torch.randn(shape, **kw) * 10 ** (torch.rand(shape, **kw) * 9 - 6)
    x *= 10 ** (torch.rand(1, h, d, **kw) * 4 - 2)  # per (head, channel): V's scale grouping
    x[torch.randint(t, (h,), **kw), torch.arange(h, device=DEV), torch.randint(d, (h,), **kw)] *= 1000
    return x


def _inputs(shape, dtype=torch.bfloat16, seed=0):
    return _values(shape, seed).to(dtype)


def _fused_qkv(t, hq, hkv, d, dtype, seed):
    """q [T, Hq, D], k, v [T, Hkv, D]: views of one [T, (Hq + 2 Hkv) * D] buffer (stride(0) = (Hq + 2 Hkv) D)."""
    buf = _values((t, hq + 2 * hkv, d), seed).to(dtype).view(t, -1)
    q = buf[:, :hq * d].view(t, hq, d)
    k = buf[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = buf[:, (hq + hkv) * d:].view(t, hkv, d)
    return q, k, v


def _ordinal(x):
    """e4m3 bytes as signed positions on the number line (+0 and -0 both 0)."""
    b = x.view(torch.uint8).to(torch.int16)
    return torch.where(b >= 128, -(b - 128), b)


def _check(got, want, ulps=1):
    """(e4m3 tensor, fp32 scale) against the reference's pair: the module docstring's tolerances (``ulps``: the
    scales')."""
    (x8, s), (x8_ref, s_ref) = got, want
    _check_scale(s, s_ref, ulps)
    _check_e4m3(x8, x8_ref)


def _check_scale(s, s_ref, ulps=1):
    assert s.dtype == torch.float32 and s.shape == s_ref.shape and s.is_contiguous(), f"scale {tuple(s.shape)}"
    if s.device.type == "cpu":
        assert torch.equal(s, s_ref), f"scales differ at {int((s != s_ref).sum())} places"
        return
    err = (s - s_ref).abs().max().item()
    assert bool(((s - s_ref).abs() <= ulps * torch.finfo(torch.float32).eps * s_ref.abs()).all()), (
        f"scales differ by more than {ulps} ulp: {err}")


def _check_e4m3(x8, x8_ref):
    assert x8.dtype == FP8_DTYPE and x8.shape == x8_ref.shape and x8.is_contiguous(), f"x8 {tuple(x8.shape)}"
    if x8.device.type == "cpu":
        diff = x8.view(torch.uint8) != x8_ref.view(torch.uint8)
        assert int(diff.sum()) == 0, f"{int(diff.sum())} of {x8.numel()} e4m3 bytes differ"
        return
    step = (_ordinal(x8) - _ordinal(x8_ref)).abs()
    assert int(step.max()) <= 1, f"e4m3 values differ by {int(step.max())} steps"
    flips = int((step > 0).sum())
    assert flips <= max(1e-4 * x8.numel(), 2), f"{flips} of {x8.numel()} e4m3 values differ by one step"


def _expected_v(v, fp8_max, order, pad_to):
    """attn_fp8.quantize_v's v8t [H, D, T] with zero keys to a multiple of pad_to, then each 64-key
    block's keys gathered in ``order`` (torch indexing), and its scale."""
    v8t, scale = attn_fp8.quantize_v(v, fp8_max)
    h, d, t = v8t.shape
    t_out = cdiv(t, pad_to) * pad_to
    full = torch.zeros(h, d, t_out, dtype=torch.uint8, device=v.device)
    full[..., :t] = v8t.view(torch.uint8)
    if order is not None:
        full = full[..., torch.cat([64 * b + order for b in range(t_out // 64)])]
    return full.view(FP8_DTYPE), scale


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("D", [16, 64])
def test_quantize_qk_and_v(T, H, D):
    x = _inputs((T, H, D), seed=1000 * T + 10 * H + D)
    _check(attn_quant.quantize_qk(x), attn_fp8.quantize_qk(x))
    _check(attn_quant.quantize_v(x), attn_fp8.quantize_v(x))


@pytest.mark.parametrize("T", [1, 65, 200])
def test_quantize_qk_norms(T):
    """quantize_qk(norms=True): the same bytes and scales, and each 64-row block's largest row norm of its e4m3 values
    per head (the FP8 attention's exp_lin bound, attention_ws_fp8.key_norms: torch's sums in another order), a
    partial last block included."""
    from gptoss_fp8.kernels.attention_ws_fp8 import key_norms

    x = _inputs((T, 3, 64), seed=77 + T) * 5
    x8, scale, n = attn_quant.quantize_qk(x, norms=True)
    _check((x8, scale), attn_fp8.quantize_qk(x))
    want = key_norms(x8)
    assert n.shape == want.shape == (3, (T + 63) // 64) and (want > 0).all()
    torch.testing.assert_close(n, want, rtol=1e-6, atol=0)
    cos, sin = spec.rope_table(T + 5, 64, device=DEV)
    q8, qs, qn = attn_quant.quantize_qk(x, norms=True, rope=(cos, sin), pos0=5)  # (Q's pass, rotated first)
    _check((q8, qs), attn_quant.quantize_qk(x, rope=(cos, sin), pos0=5))
    torch.testing.assert_close(qn, key_norms(q8), rtol=1e-6, atol=0)


_NORMS_COMPILE = r"""
import json
from gptoss_fp8.kernels import attn_quant
from gptoss_fp8.kernels._gluon import triton_ptx_for_sm90

types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "n_ptr": "*fp32"}
out = {}
for rope in (False, True):
    const = dict(BLOCK_T=64, BLOCK_H=1, D=64, FP8_MAX_C=448.0, EPS=1e-10, blk_ptr=None, BLOCKED=False,
                 HEADS_FAST=True, ROPE=rope, NORMS=True)
    out[str(rope)] = "sqrt" in triton_ptx_for_sm90(attn_quant._quantize_qk_kernel, types, const, 8, 1, None,
                                                   ("x_ptr", "q_ptr"))
print(json.dumps(out))
"""


def test_quantize_qk_norms_compile_for_sm90():
    """quantize_qk(norms=True) compiles for sm_90 with and without a rope (on the GPU the quantized values are e4m3,
    not the interpreter's fp32: their square failed to lower there until cast; forty-sixth session)."""
    from sm90_compile import run_compile_script

    assert run_compile_script(_NORMS_COMPILE) == {"False": True, "True": True}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_dtype_and_fp8_max(dtype, fp8_max):
    x = _inputs((130, 3, 64), dtype, seed=int(fp8_max) + dtype.itemsize)
    _check(attn_quant.quantize_qk(x, fp8_max), attn_fp8.quantize_qk(x, fp8_max))
    _check(attn_quant.quantize_v(x, fp8_max), attn_fp8.quantize_v(x, fp8_max))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_views(dtype):
    """q, k, v as slices of a fused qkv buffer, and a view whose head stride is not D."""
    q, k, v = _fused_qkv(65, 3, 1, 64, dtype, seed=7)
    assert q.stride() == (5 * 64, 64, 1) and not v.is_contiguous()
    for x in (q, k):
        _check(attn_quant.quantize_qk(x), attn_fp8.quantize_qk(x))
    _check(attn_quant.quantize_v(v), attn_fp8.quantize_v(v))
    every_other = _inputs((63, 6, 16), dtype, seed=8)[:, ::2]  # stride(1) = 2 D
    _check(attn_quant.quantize_qk(every_other), attn_fp8.quantize_qk(every_other))
    _check(attn_quant.quantize_v(every_other), attn_fp8.quantize_v(every_other))


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_quantize_v_key_order(T):
    """V for the Gluon FP8 kernel: padded to 64 keys, each block in attention_ws_fp8.key_order, and in a
    random permutation (the kernel's gather takes any)."""
    from gptoss_fp8.kernels.attention_ws_fp8 import key_order

    _, _, v = _fused_qkv(T, 3, 2, 64, torch.bfloat16, seed=T)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(T)).to(DEV)
    for order in (key_order(), perm):  # on the GPU: a CPU order (copied once) and one on the device
        got = attn_quant.quantize_v(v, key_order=order, pad_to=64)
        _check(got, _expected_v(v, 448.0, order, 64))


@pytest.mark.parametrize("pad_to", [16, 128])
def test_quantize_v_padding(pad_to):
    v = _inputs((65, 1, 16), seed=pad_to)
    _check(attn_quant.quantize_v(v, pad_to=pad_to), _expected_v(v, 448.0, None, pad_to))


def test_zero_block_and_channel():
    # An all-zero Q / K block and an all-zero V channel take the eps scale and quantize to zeros
    # (the one place zeros are right).
    x = _inputs((130, 3, 16), seed=9)
    x[64:128, 1] = 0
    x[:, 2, 5] = 0
    _check(attn_quant.quantize_qk(x), attn_fp8.quantize_qk(x))
    _check(attn_quant.quantize_v(x), attn_fp8.quantize_v(x))


@pytest.mark.parametrize("T,pos0", [(1, 0), (65, 0), (130, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_qk_with_rope(T, pos0, dtype):
    """rope=(cos, sin): x rotated in the kernel (row t at position pos0 + t) before its quantization,
    kernels/rope.py's arithmetic and its one rounding to x's dtype: the bytes and scales of quantizing
    rope_qk's output (the unfused kernels; on a fused qkv view's strides), and on the GPU (or in fp32)
    within the module's tolerance of ``spec.apply_rope(..., dtype=torch.float32)`` quantized by the
    reference (Triton's interpreter truncates fp32 to bf16 where torch rounds to nearest)."""
    from gptoss_fp8 import spec
    from gptoss_fp8.kernels.rope import rope_qk

    q, k, _ = _fused_qkv(T, 3, 1, 64, dtype, seed=T + pos0)
    cos, sin = spec.rope_table(pos0 + T + 5, 64, device=DEV)
    rows = slice(pos0, pos0 + T)
    pos = torch.arange(pos0, pos0 + T, device=DEV, dtype=torch.int32)
    for x in (q, k):
        got = attn_quant.quantize_qk(x, rope=(cos, sin), pos0=pos0)
        unfused = attn_quant.quantize_qk(rope_qk(None, x, pos, cos, sin)[1])
        assert torch.equal(got[0].view(torch.uint8), unfused[0].view(torch.uint8)) and torch.equal(got[1], unfused[1])
        if DEV == "cuda" or dtype == torch.float32:
            # fp32 x: the kernel rotates by one FMA, the spec by two products and a sum, a value apart by up to
            # an ulp; the group's amax so, and its scale (amax / 448, rounded) by up to 2 ulps (the H100, the
            # thirty-fourth session: 2 ulps at one of 9 groups); bf16 x rounds both to the same value
            _check(got, attn_fp8.quantize_qk(spec.apply_rope(x, cos[rows], sin[rows], dtype=torch.float32)),
                   ulps=2 if dtype == torch.float32 else 1)
    with pytest.raises(AssertionError, match="rope tables"):
        attn_quant.quantize_qk(q, rope=(cos[: pos0 + T - 1], sin[: pos0 + T - 1]), pos0=pos0)


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_segment_plan(fp8_max):
    """attn_quant.SegmentPlan (a serving step's chunks after cached keys under ``--attention fp8``): each chunk's Q
    rows, keys (a cache's rows; rows no chunk owns NaN, never read) and V quantized in one pass each against
    quantizing that chunk's own tensors: its Q / K blocks of 64 from its first row / key, V's channel scales over
    its own keys (a chunk of 1100 keys: V's amax over two partial chunks), the padded keys of V zero."""
    x = _inputs((2430, 2, 64), seed=20 + int(fp8_max))
    k = torch.full_like(x, float("nan"))
    q = _inputs((1300, 4, 64), seed=21)
    rows, starts, offsets = [0, 70, 71, 1171, 1300], [0, 200, 1000, 2300], [5, 0, 30, 1]  # keys 75, 1, 1130, 130
    for a, b, k0, off in zip(rows[:-1], rows[1:], starts, offsets, strict=True):
        k[k0:k0 + off + b - a] = x[k0:k0 + off + b - a]
    plan = attn_quant.SegmentPlan(rows, starts, offsets, DEV)
    q8, sq, k8, sk, v8t, sv = plan.operands(q, k, k * 0.5, fp8_max)
    assert plan.keys_out == 128 + 64 + 1152 + 192 and sv.shape == (4, 2, 64)
    assert plan.k_starts8.tolist() == [0, 128, 192, 1344] and plan.q_scale_base.tolist() == [0, 2, 3, 21]
    for i, (a, b, k0, off) in enumerate(zip(rows[:-1], rows[1:], starts, offsets, strict=True)):
        nq, nk, qs, ks = b - a, off + b - a, plan.q_scale_base[i].item(), plan.k_starts8[i].item()
        _check((q8[a:b].contiguous(), sq[:, qs:qs + cdiv(nq, 64)].contiguous()), attn_fp8.quantize_qk(q[a:b], fp8_max))
        kk = k[k0:k0 + nk]
        _check((k8[ks:ks + nk].contiguous(), sk[:, ks // 64:ks // 64 + cdiv(nk, 64)].contiguous()),
               attn_fp8.quantize_qk(kk, fp8_max))
        _check((v8t[:, :, ks:ks + nk].contiguous(), sv[i]), attn_fp8.quantize_v(kk * 0.5, fp8_max))
        assert not v8t[:, :, ks + nk:ks + cdiv(nk, 64) * 64].float().any(), f"chunk {i}: V's padded keys not zero"
    with pytest.raises(AssertionError, match="read key rows up to 2430"):
        plan.operands(q, k[:2429], k[:2429])


def test_bad_inputs():
    x = _inputs((8, 2, 64), seed=10)
    with pytest.raises(AssertionError, match=r"x \(8, 2, 32\).*head_dim must be contiguous"):
        attn_quant.quantize_qk(x[..., ::2])
    with pytest.raises(AssertionError, match=r"v \(8, 128\): want \[T, H, D\]"):
        attn_quant.quantize_v(x.view(8, 128))
    with pytest.raises(AssertionError, match="head_dim 48"):
        attn_quant.quantize_qk(x[..., :48])
    with pytest.raises(AssertionError, match="pad_to 1: key_order needs whole blocks"):
        attn_quant.quantize_v(x, key_order=torch.arange(64, device=DEV))
    with pytest.raises(AssertionError, match="not a permutation"):
        attn_quant.quantize_v(x, key_order=torch.zeros(64, dtype=torch.int64), pad_to=64)


@pytest.mark.gpu
def test_fp8_operands_fused_gpu():
    """attention_ws_fp8.fp8_operands on CUDA (the fused kernels) against quant/attn_fp8.py on the same
    device, V padded and gathered in key_order here."""
    from gptoss_fp8.kernels.attention_ws_fp8 import LOG2E, fp8_operands, key_order

    q, k, v = _fused_qkv(4097, 64, 8, 64, torch.bfloat16, seed=11)
    q8, sq, k8, sk, vt, svs, kn, qn = fp8_operands(q, k, v, 0.125)
    assert kn is None and qn is None  # (asked for neither)
    rq8, rsq = attn_fp8.quantize_qk(q)
    _check_e4m3(q8, rq8)
    _check_scale(sq, rsq * (0.125 * LOG2E), ulps=2)  # a 1-ulp scale difference, then one more rounding
    _check((k8, sk), attn_fp8.quantize_qk(k))
    v8t, sv = _expected_v(v, 448.0, key_order(DEV), 64)
    _check((vt, svs), (v8t.view(8 * 64, -1), sv / 256))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [70000, 131072])
def test_large_gpu(T):
    from gptoss_fp8.kernels.attention_ws_fp8 import key_order

    q, k, v = _fused_qkv(T, 64, 8, 64, torch.bfloat16, seed=T)
    _check(attn_quant.quantize_qk(q), attn_fp8.quantize_qk(q))
    _check(attn_quant.quantize_qk(k), attn_fp8.quantize_qk(k))
    _check(attn_quant.quantize_v(v), attn_fp8.quantize_v(v))
    order = key_order(DEV)
    _check(attn_quant.quantize_v(v, key_order=order, pad_to=64), _expected_v(v, 448.0, order, 64))

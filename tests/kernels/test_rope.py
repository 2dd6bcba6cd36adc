"""YaRN rope kernel against gpt-oss's RotaryEmbedding and a plain fp32 torch reference.

The kernel computes in fp32 and rounds once; the interpreter truncates bf16 stores, so the bound
against the fp32 reference is one bf16 ulp (rtol 1e-2). gpt-oss itself computes in bf16 with bf16
cos/sin: against it, a few bf16 ulps (rtol 3e-2, atol 3e-2).
"""

import pytest
import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.rope import rope_qk


def rope_cos_sin(n, device=None):
    return spec.rope_table(n, 64, device=device)


def rope_ref(x, positions, cos, sin):
    """The kernel's arithmetic in plain torch: fp32, rounded once to x's dtype."""
    return spec.apply_rope(x, cos, sin, positions, dtype=torch.float32)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
YARN = dict(initial_context_length=4096, scaling_factor=32.0, ntk_alpha=1.0, ntk_beta=32.0)  # gpt-oss


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)


def test_cos_sin_table_matches_openai():
    model = pytest.importorskip("gpt_oss.torch.model")
    re = model.RotaryEmbedding(64, 150000, torch.float32, **YARN)
    conc, inv = re._compute_concentration_and_inv_freq()
    conc2, inv2 = spec.yarn_inv_freq()
    assert conc == conc2 and torch.equal(inv, inv2)
    cos, sin = re._compute_cos_sin(4096)
    cos2, sin2 = rope_cos_sin(4096)
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)


def test_rope_matches_openai():
    model = pytest.importorskip("gpt_oss.torch.model")
    gen = torch.Generator().manual_seed(0)
    T = 61
    re = model.RotaryEmbedding(64, 150000, torch.float32, **YARN)
    q, k = _rand(T, 8, 64, gen=gen), _rand(T, 2, 64, gen=gen)
    cos, sin = rope_cos_sin(T, device=DEV)
    qo, ko = rope_qk(q, k, torch.arange(T, device=DEV), cos, sin)
    qr, kr = re(q.cpu().view(T, 2, 4, 64), k.cpu())
    torch.testing.assert_close(qo.float().cpu(), qr.float().view(T, 8, 64), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ko.float().cpu(), kr.float(), atol=3e-2, rtol=3e-2)


def test_rope_positions_strided_inplace():
    """Arbitrary positions (ragged / decode) on views into a fused qkv buffer, in place; v untouched."""
    gen = torch.Generator().manual_seed(1)
    T, hq, hkv = 37, 8, 2
    cos, sin = rope_cos_sin(131072, device=DEV)
    pos = torch.randint(0, 131072, (T,), generator=gen).to(DEV)
    qkv = _rand(T, hq + 2 * hkv, 64, gen=gen)
    qv, kv, vv = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    want_q, want_k, v0 = rope_ref(qv.float(), pos, cos, sin), rope_ref(kv.float(), pos, cos, sin), vv.clone()
    rope_qk(qv, kv, pos, cos, sin, inplace=True)
    torch.testing.assert_close(qv.float(), want_q, atol=1e-4, rtol=1e-2)
    torch.testing.assert_close(kv.float(), want_k, atol=1e-4, rtol=1e-2)
    assert torch.equal(vv, v0)


@pytest.mark.gpu
def test_rope_gpu_long():
    gen = torch.Generator().manual_seed(2)
    T = 8192
    cos, sin = rope_cos_sin(T, device=DEV)
    q, k = _rand(T, 64, 64, gen=gen), _rand(T, 8, 64, gen=gen)
    pos = torch.arange(T, device=DEV)
    qo, ko = rope_qk(q, k, pos, cos, sin)
    torch.testing.assert_close(qo.float(), rope_ref(q.float(), pos, cos, sin), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ko.float(), rope_ref(k.float(), pos, cos, sin), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("b,hq,hkv,rows", [(1, 8, 2, 16), (3, 12, 4, 5), (5, 64, 8, 128)])
def test_rope_append_matches_rope_then_indexed_store(b, hq, hkv, rows):
    """One launch (q, k rotated; k, v into the cache at each sequence's row) leaves exactly what
    ``rope_qk`` followed by an indexed store leaves: q and the cache bit for bit, other rows untouched."""
    from gptoss_fp8.kernels.rope import rope_append

    gen = torch.Generator().manual_seed(b * 100 + hq)
    qkv = _rand(b, (hq + 2 * hkv) * 64 + 64, gen=gen)  # strided views of one row, as the fused projection gives
    q = qkv[:, : hq * 64].view(b, hq, 64)
    k = qkv[:, hq * 64 : (hq + hkv) * 64].view(b, hkv, 64)
    v = qkv[:, (hq + hkv) * 64 : (hq + 2 * hkv) * 64].view(b, hkv, 64)
    cos, sin = (t.to(DEV) for t in rope_cos_sin(4096))
    positions = torch.randint(0, 4096, (b,), generator=gen).to(DEV)
    slots = torch.randint(0, rows, (b,), generator=gen).to(DEV)
    kc, vc = _rand(b, rows, hkv, 64, gen=gen), _rand(b, rows, hkv, 64, gen=gen)
    kc0, vc0 = kc.clone(), vc.clone()
    qo = rope_append(q, k, v, positions, cos, sin, kc, vc, slots)
    want_q, want_k = rope_qk(q, k, positions, cos, sin)
    seq = torch.arange(b, device=DEV)
    kc0[seq, slots] = want_k
    vc0[seq, slots] = v
    assert torch.equal(qo, want_q) and torch.equal(kc, kc0) and torch.equal(vc, vc0)
    torch.testing.assert_close(qo.float(), rope_ref(q, positions, cos, sin).float(), rtol=1e-2, atol=1e-2)

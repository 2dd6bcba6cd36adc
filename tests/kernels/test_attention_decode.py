"""The decode kernel on a sliding layer's ring cache (``attention_decode(..., ring=True)``), and its
arrival counters across growing launches (what CUDA graphs captured earlier rely on).

Reference: each sequence's keys generated in position order, the sliding-window attention of its
newest query over them (``spec.attention`` in fp32, window = ring rows); the kernel reads the
same keys scattered into a ring of ``window`` rows (position p in row p % window), so a ring
placement bug or a cap on the wrong length fails here, not only a softmax bug. Tolerances as
tests/kernels/test_attention.py (CPU: interpreter, truncating bf16 stores: 6e-3 on the norm,
rtol 1e-2; GPU: 1e-2 on the norm, 3e-2 elementwise).
"""

import pytest
import torch

from gptoss_fp8 import spec
from gptoss_fp8.kernels.attention_decode import attention_decode, attention_decode_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
interpreter_only = pytest.mark.skipif(HAS_CUDA, reason="interpreter test on CPU tensors (a GPU is visible)")


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=torch.bfloat16)


def _ring_case(lengths, window, hq, hkv, d, seed):
    """(q [B, 1, hq, d], ring k / v [B, window, hkv, d], kv_lens, sinks, reference [B, 1, hq, d])."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = _rand(B, 1, hq, d, gen=gen)
    sinks = (torch.rand(hq, generator=gen) * 20 - 10).to(device=DEV, dtype=torch.bfloat16)
    sinks[0] = 10.0  # an extreme sink: counted twice it would show
    # a ring of NaN: a row the kernel should not read poisons the output
    ring_k = torch.full((B, window, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    ring_v = ring_k.clone()
    ref = torch.empty_like(q)
    for b, n in enumerate(lengths):
        k, v = _rand(n, hkv, d, gen=gen), _rand(n, hkv, d, gen=gen)
        keep = torch.arange(max(0, n - window), n)
        ring_k[b, keep % window] = k[keep]
        ring_v[b, keep % window] = v[keep]
        ref[b] = spec.attention(q[b].float(), k.float(), v.float(), sinks, None, window, q_offset=n - 1,
                                dtype=torch.float32)
    return q, ring_k, ring_v, torch.tensor(lengths, dtype=torch.int32, device=DEV), sinks, ref


def _check(out, ref):
    o, r = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(o).all(), "non-finite output: an unwritten row, or a ring row read past the held ones"
    rel = ((o - r).norm() / r.norm()).item()
    if HAS_CUDA:
        assert rel < 1e-2, f"relative error {rel:.2e}"
        torch.testing.assert_close(o, r, atol=3e-2, rtol=3e-2)
    else:
        assert rel < 6e-3, f"relative error {rel:.2e}"
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-2)


# lengths: ring not full (n < window, rows n.. are NaN), exactly full, wrapped once / many times
RING_CASES = [([5, 16, 37, 1], 16, 8, 2, 64), ([3, 130, 128, 700], 128, 16, 2, 64), ([9, 8, 100], 8, 8, 2, 16)]


@interpreter_only
@pytest.mark.parametrize("lengths,window,hq,hkv,d", RING_CASES)
@pytest.mark.parametrize("splits", [None, 1])
def test_ring_cpu(lengths, window, hq, hkv, d, splits):
    q, k, v, kl, sinks, ref = _ring_case(lengths, window, hq, hkv, d, seed=window + len(lengths))
    out = attention_decode(q, k, v, kl, sinks, num_splits=splits, ring=True)
    _check(out, ref)
    # the launcher's own reference of the ring contract agrees (NaN rows past the held ones unread)
    _check(attention_decode_ref(q.float(), k.float(), v.float(), kl, sinks, ring=True), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 64])
def test_ring_gpu(batch):
    """gpt-oss shapes: window 128, 64 q heads over 8 kv heads, head_dim 64."""
    lengths = [(37 * b * b + 5) % 9000 + 1 for b in range(batch)]
    lengths[0] = 128
    q, k, v, kl, sinks, ref = _ring_case(lengths, 128, 64, 8, 64, seed=batch)
    for _ in range(2):
        _check(attention_decode(q, k, v, kl, sinks, ring=True), ref)


def test_ring_rejects_more_than_one_query_or_a_window():
    q = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16, device=DEV)
    kc = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16, device=DEV)
    kl = torch.tensor([8], dtype=torch.int32, device=DEV)
    sinks = torch.zeros(4, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(AssertionError, match="one new query"):
        attention_decode(q, kc, kc, kl, sinks, ring=True)
    with pytest.raises(AssertionError, match="window"):
        attention_decode(q[:, :1], kc, kc, kl, sinks, sliding_window=4, ring=True)


def test_counters_outlive_a_larger_launch():
    """A launch needing more arrival counters than exist replaces the buffer but keeps the old one
    alive (a CUDA graph captured before still points at it), and leaves the new one zeroed."""
    import gptoss_fp8.kernels as mod

    dev = torch.device(DEV)
    first = mod.arrival_counters(dev, 4)
    bigger = mod.arrival_counters(dev, first.numel() + 1)
    assert bigger.numel() > first.numel() and any(t is first for t in mod._RETIRED)
    assert mod.arrival_counters(dev, 4) is bigger and not bigger.any()

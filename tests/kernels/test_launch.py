"""Launch helpers of kernels/__init__.py: programmatic dependent launch (PDL) switch.

PDL lets a kernel be scheduled while the previous one finishes; every PDL kernel first waits for
its predecessor (``pdl_prologue``), so results must be bit-identical with PDL on and off. The GPU
test chains dependent kernels (norm -> GEMM -> attention -> act_quant -> GEMM), where a kernel
that started early would read unfinished data, and compares the two modes bit for bit.
"""

import pytest
import torch

import gptoss_fp8.kernels as kernels


def test_pdl_args_off_the_gpu_and_when_disabled(monkeypatch):
    assert kernels.pdl_args(torch.device("cpu")) == {}
    monkeypatch.setattr(kernels, "PDL_ENABLED", False)
    assert kernels.pdl_args(torch.device("cuda", 0)) == {}


@pytest.mark.gpu
def test_pdl_chain_is_bit_identical_gpu(monkeypatch):
    from gptoss_fp8.kernels.act_quant import act_quant
    from gptoss_fp8.kernels.attention import attention_prefill
    from gptoss_fp8.kernels.fp8_gemm import fp8_gemm
    from gptoss_fp8.kernels.norm import rms_norm_quant
    from gptoss_fp8.quant.fp8 import quantize_weight_blocks

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    g = torch.Generator().manual_seed(21)
    t, h = 3000, 2880
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    d = torch.randn(t, h, generator=g).bfloat16().cuda()
    nw = (torch.rand(h, generator=g) + 0.5).cuda()
    w1, s1 = (a.cuda() for a in quantize_weight_blocks(torch.randn(1024, h, generator=g) / 50))
    w2, s2 = (a.cuda() for a in quantize_weight_blocks(torch.randn(h, 512, generator=g) / 20))
    sinks = torch.randn(8, generator=g).bfloat16().cuda()

    def chain():
        outs = []
        xo = x
        for _ in range(3):  # the caching allocator hands each step's buffers to the next
            xo, y, (q, s) = rms_norm_quant(xo, d, nw, 1e-5)
            qkv = fp8_gemm(q, s, w1, s1).view(t, 16, 64)
            o = attention_prefill(qkv[:, :8].contiguous(), qkv[:, 8:12], qkv[:, 12:], sinks, sliding_window=128)
            oq, os_ = act_quant(o.reshape(t, 512))
            delta = fp8_gemm(oq, os_, w2, s2)
            outs.append(delta)
            d.copy_(delta)
        return [o.clone() for o in outs]

    d0 = d.clone()
    monkeypatch.setattr(kernels, "PDL_ENABLED", True)
    on = chain()
    d.copy_(d0)
    monkeypatch.setattr(kernels, "PDL_ENABLED", False)
    off = chain()
    for a, b in zip(on, off):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        assert torch.equal(a, b)

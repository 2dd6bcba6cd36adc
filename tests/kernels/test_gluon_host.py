"""The Gluon launchers' host code, run on CPU with the kernels stubbed out (the interpreter cannot
run Gluon kernels, and without this their host paths would only ever run on the GPU): each builds
its TMA descriptors over the right tensors and blocks, and launches the expected grid."""

from __future__ import annotations

import pytest
import torch

from gptoss_fp8.kernels import _gluon

pytestmark = pytest.mark.skipif(not _gluon.HAS_GLUON, reason="this triton has no Gluon Hopper API")

FP8 = torch.float8_e4m3fn


class _Stub:
    """Stands in for a Gluon kernel: records grid, arguments and keywords of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def _desc(d, tensor, block):
    assert isinstance(d, _gluon.TensorDescriptor), type(d)
    assert d.base.data_ptr() == tensor.data_ptr() and list(d.shape) == list(tensor.shape)
    assert list(d.block_shape) == block


def test_dense_gemm_launcher(monkeypatch):
    from gptoss_fp8.kernels import fp8_gemm_ws

    stub = _Stub()
    monkeypatch.setattr(fp8_gemm_ws, "_ws_fp8_gemm_kernel", stub)
    m, n, k = 1000, 384, 256
    x, w, out = torch.zeros(m, k, dtype=FP8), torch.zeros(n, k, dtype=FP8), torch.empty(m, n, dtype=torch.bfloat16)
    fp8_gemm_ws.ws_fp8_gemm(x, torch.ones(m, 2), w, torch.ones(3, 2), None, out, stages=5)
    (grid, args, kw), = stub.calls
    assert grid == (4,)  # min(8 x 3 tiles, 4 "SMs" off the GPU)
    _desc(args[0], x, [128, 128])
    _desc(args[1], w, [128, 128])
    _desc(args[5], out, [64, 128])
    assert kw["STAGES"] == 5 and kw["HAS_BIAS"] is False


def test_moe_launcher(monkeypatch):
    from gptoss_fp8.kernels import moe_ws

    stub = _Stub()
    monkeypatch.setattr(moe_ws, "_ws_moe_gemm_kernel", stub)
    e, n, k, rows = 4, 512, 256, 128
    a, w = torch.zeros(rows, k, dtype=FP8), torch.zeros(e, n, k, dtype=FP8)
    out, out_s = torch.empty(rows, n // 2, dtype=FP8), torch.empty(rows, 2)
    moe_ws.ws_moe_gemm(a, torch.ones(rows, 2), w, torch.ones(e, 4, 2), torch.zeros(e, n), out, out_s,
                       torch.arange(rows, dtype=torch.int32), torch.zeros(rows // 64, dtype=torch.int32), rows, 7.0,
                       1.702, 448.0, 1e-10, stages=5, group_m=4)
    (grid, args, kw), = stub.calls
    assert grid == (4,)  # min(2 row tiles x 2 column tiles, 4 "SMs" off the GPU)
    _desc(args[0], a, [64, 128])
    _desc(args[1], w.view(e * n, k), [256, 128])
    _desc(args[6], out, [64, 64])
    assert args[7] is out_s and kw["STAGES"] == 5 and kw["GROUP_M"] == 4


def test_attention_launcher(monkeypatch):
    from gptoss_fp8.kernels import attention_ws

    stub = _Stub()
    monkeypatch.setattr(attention_ws, "_ws_attention_kernel", stub)
    T = 300
    q, kv = torch.zeros(T, 64, 64, dtype=torch.bfloat16), torch.zeros(T, 8, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    attention_ws.ws_attention_prefill(q, kv, kv.clone(), torch.zeros(64, dtype=torch.bfloat16), out, 0.125,
                                      block_n=64, stages=4, warpgroups=3)
    (grid, args, kw), = stub.calls
    assert grid == (64, 2)  # heads x ceil(300 / 192) programs of 3 x 64 queries
    for d, blk in zip(args[:4], (64, 64, 64, 64), strict=True):
        assert list(d.block_shape) == [blk, 64]
    assert kw["NWG"] == 3 and kw["GROUP"] == 8

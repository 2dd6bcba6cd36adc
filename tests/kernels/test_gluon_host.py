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


def test_dense_gemm_residual_launcher(monkeypatch):
    """``ws_fp8_gemm(residual=)``: the wide kernel gets a descriptor over the residual in the store tiles' blocks and
    RES; the 128 x 128 tile (its store buffers cannot hold a residual) refuses it in one line."""
    from gptoss_fp8.kernels import fp8_gemm_ws

    stub = _Stub()
    monkeypatch.setattr(fp8_gemm_ws, "_ws_fp8_gemm_wide_kernel", stub)
    m, n, k = 1000, 384, 4096
    x, w = torch.zeros(m, k, dtype=FP8), torch.zeros(n, k, dtype=FP8)
    out, r = torch.empty(m, n, dtype=torch.bfloat16), torch.ones(m, n, dtype=torch.bfloat16)
    fp8_gemm_ws.ws_fp8_gemm(x, torch.ones(m, 32), w, torch.ones(3, 32), None, out, stages=3, block_n=256,
                            promote="serial", residual=r)
    (grid, args, kw), = stub.calls
    _desc(args[5], out, [64, 128])
    _desc(kw["r_desc"], r, [64, 128])
    assert kw["RES"] is True and kw["C_BUFS"] == 2
    with pytest.raises(ValueError, match="residual"):
        fp8_gemm_ws.ws_fp8_gemm(x, torch.ones(m, 32), w, torch.ones(3, 32), None, out, stages=5, residual=r)


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


@pytest.mark.parametrize("m,k_blocks", [(4097, 23), (136, 23), (1, 23), (256, 32), (999, 29), (200, 2), (700, 5), (64, 6)])
def test_stage_scales_boxes_start_16_byte_aligned(m, k_blocks):
    """``GluonTile.stage_scales``: a tiled TMA box must start on a 16-byte boundary (an "illegal instruction"
    otherwise, measured: benchmarks/tma1d_probe.py). The row scales' K blocks lie ceil(M / 4) * 4 floats apart in
    the flat MN-major copy (the same values, zeros between); the weight scales' box, started at the multiple of 4
    at or below a K block's scale (``load_stage_scaled``), holds that scale and the next 128-column block's."""
    gen = torch.Generator().manual_seed(m + k_blocks)
    a_scale = torch.rand(m, k_blocks, generator=gen) + 0.5
    w_scale = torch.rand(7, 3, k_blocks, generator=gen) + 0.5  # [E, N / 128, K blocks]
    sc, ws = _gluon.stage_scale_args(a_scale, w_scale, 128)
    sa = sc["sa_desc"].base
    mp = -(-m // 4) * 4
    assert sa.shape == (k_blocks * mp,) and sa.data_ptr() % 16 == 0
    rows = sa.view(k_blocks, mp)
    assert torch.equal(rows[:, :m], a_scale.t()) and not rows[:, m:].any()
    # the producer's row-scale box starts (kk * mp + pid_m * 128) * 4 bytes in: 16-byte aligned
    assert all((kk * mp + p * 128) % 4 == 0 for kk in range(k_blocks) for p in range(3))
    box = sc["sb_desc"].block_shape[0]
    # each stage's box a 128-byte row of its buffer: a TMA destination starts on a 128-byte boundary
    assert box & (box - 1) == 0 and box * 4 % 128 == 0 and box >= k_blocks + 3
    assert torch.equal(sc["sb_desc"].base, ws.view(-1))
    flat = ws.view(-1)
    for e in range(7):
        for pid_n in range(1):  # (a 256-wide tile: blocks 2 pid_n and 2 pid_n + 1)
            for kk in range(k_blocks):
                off = e * ws.stride(0) + 2 * pid_n * ws.stride(1) + kk
                start = off - off % 4
                got = flat[start:start + box]
                at = off % 4  # _gluon._sb_start's index
                assert got[at] == w_scale[e, 2 * pid_n, kk] and got[at + ws.stride(1)] == w_scale[e, 2 * pid_n + 1, kk]

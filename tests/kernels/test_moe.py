"""Fused FP8 MoE (Triton) against the plain-torch w8a8 specification ``moe_experts_reference``.

Routing is the same torch function in both (bf16 logits, sorted top-k, bf16 softmax), so the two
pick the same experts; the reference then quantizes x per token (1x128), runs the block GEMMs in
fp32 with dequantized operands, SwiGLU in fp32, quantizes the intermediate (1x128), rounds each
expert's down output to bf16 and sums the weighted outputs in fp32.
Tolerances on the bf16 [T, H] output (fp32 accumulation order and sigmoid implementation differ,
which can flip a rare fp8 rounding of the intermediate):
- GPU: ||y - ref|| / ||ref|| <= 5e-3 and max |y - ref| <= 2e-2 max|ref|;
- CPU interpreter (two truncating bf16 stores): ||y - ref|| / ||ref|| <= 1.2e-2, max <= 3e-2 max|ref|.
"""

import pytest
import torch

from gptoss_fp8.kernels.act_quant import act_quant
from gptoss_fp8.kernels.moe import (
    fused_moe,
    fused_moe_reference,
    gather_act_quant,
    moe_align,
    moe_align_reference,
    moe_combine,
    moe_experts,
    moe_experts_reference,
    route,
    zero_foreign_rows,
)
from gptoss_fp8.quant.fp8 import quantize_weight_blocks

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
REL_NORM, REL_MAX = (5e-3, 2e-2) if HAS_CUDA else (1.2e-2, 3e-2)


def _model(t, h, i, e, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=DEV) * scale

    w13, s13 = quantize_weight_blocks(randn(e, 2 * i, h, scale=h**-0.5))
    w2, s2 = quantize_weight_blocks(randn(e, h, i, scale=i**-0.5))
    return dict(
        x=randn(t, h, scale=1.5).to(torch.bfloat16),
        wr=randn(e, h, scale=h**-0.5).to(torch.bfloat16),
        br=randn(e, scale=0.1).to(torch.bfloat16),
        experts=(w13, s13, randn(e, 2 * i, scale=0.3).to(torch.bfloat16), w2, s2, randn(e, h, scale=0.1).to(torch.bfloat16)),
    )


def _shard(experts, e0, n):
    return tuple(t[e0:e0 + n].contiguous() for t in experts)


def _check(y, ref):
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert not torch.isnan(y).any()
    y, ref = y.float(), ref.float()
    rel = ((y - ref).norm() / ref.norm()).item()
    mx = ((y - ref).abs().max() / ref.abs().max()).item()
    assert rel <= REL_NORM and mx <= REL_MAX, f"relative error {rel:.2e} (<= {REL_NORM}), max {mx:.2e} (<= {REL_MAX})"


def test_route_matches_gpt_oss():
    m = _model(16, 160, 64, 8, seed=1)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    logits = torch.nn.functional.linear(m["x"], m["wr"], m["br"])
    top = torch.topk(logits, 4, dim=-1, sorted=True)
    assert torch.equal(ids.long(), top.indices)
    assert torch.equal(w, torch.softmax(top.values, dim=-1)) and w.dtype == torch.bfloat16


@pytest.mark.parametrize("e0,n_local,block_m", [(0, 8, 16), (2, 3, 16), (5, 3, 64), (0, 128, 64)])
def test_moe_align_matches_reference(e0, n_local, block_m):
    g = torch.Generator().manual_seed(e0 + n_local)
    ids = torch.randint(0, max(8, n_local), (50, 4), generator=g, dtype=torch.int32).to(DEV)
    slots, block_expert = moe_align(ids, e0, n_local, block_m)
    ref_slots, ref_block_expert = moe_align_reference(ids, e0, n_local, block_m)
    assert torch.equal(block_expert.cpu(), ref_block_expert.cpu())
    # Same slots in the same padded segments; the order inside a segment may differ (atomics).
    n = ids.numel()
    for tile in range(block_expert.numel()):
        got = slots[tile * block_m:(tile + 1) * block_m].cpu()
        want = ref_slots[tile * block_m:(tile + 1) * block_m].cpu()
        assert int((got < n).sum()) == int((want < n).sum())
    seg = lambda s: sorted(s[s < n].tolist())  # noqa: E731
    assert seg(slots.cpu()) == seg(ref_slots.cpu())
    flat = ids.reshape(-1).cpu() - e0
    for row, s in enumerate(slots.cpu().tolist()):
        if s < n:
            assert block_expert[row // block_m].item() == flat[s].item()


@pytest.mark.parametrize(
    "t,h,i,e,k,e0,n_local",
    [(24, 160, 192, 8, 4, 0, 8), (24, 160, 192, 8, 4, 2, 4), (5, 128, 64, 4, 2, 0, 4), (40, 160, 160, 16, 4, 12, 4)],
)
def test_fused_moe_small(t, h, i, e, k, e0, n_local):
    m = _model(t, h, i, e, seed=t + e0)
    ex = _shard(m["experts"], e0, n_local)
    y = fused_moe(m["x"], m["wr"], m["br"], *ex, top_k=k, expert_start=e0)
    _check(y, fused_moe_reference(m["x"], m["wr"], m["br"], *ex, top_k=k, expert_start=e0))


@pytest.mark.parametrize("tma,pregather,split", [(True, False, True), (False, False, True), (True, True, True),
                                                 (True, False, False), (False, False, False)])
def test_fused_moe_tiles_and_loads(tma, pregather, split):
    # Padding to 32 rows with 16-row gate_up tiles and 32-row down tiles; TMA or pointer loads;
    # gate_up's A gathered by the GEMM or pre-gathered in sorted order (gather_act_quant); gate_up
    # as two 128-column products (split) or one 256-column product with per-column weight scales
    # (and down likewise, 256 columns wide, past H=160).
    cfg = dict(
        ALIGN_M=32, TMA=tma, PREGATHER=pregather,
        gate_up=dict(BLOCK_M=16, BLOCK_N=256, GROUP_M=2, num_warps=4, num_stages=2, SPLIT_N=split),
        down=dict(BLOCK_M=32, BLOCK_N=64 if split else 256, GROUP_M=2, num_warps=4, num_stages=2, SPLIT_N=split),
    )
    m = _model(30, 160, 192, 8, seed=21)
    ex = _shard(m["experts"], 2, 5)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    _check(moe_experts(m["x"], w, ids, *ex, expert_start=2, config=cfg), moe_experts_reference(m["x"], w, ids, *ex, expert_start=2))


def test_expert_parallel_ranks_sum_to_full():
    m = _model(20, 160, 128, 8, seed=9)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    full = moe_experts(m["x"], w, ids, *m["experts"]).float()
    parts = [moe_experts(m["x"], w, ids, *_shard(m["experts"], e0, 4), expert_start=e0).float() for e0 in (0, 4)]
    # One all-reduce of the ranks' partial sums: equal up to the bf16 rounding of each part.
    assert ((parts[0] + parts[1] - full).norm() / full.norm()).item() < 1e-2


def test_rank_with_no_routed_tokens_returns_zeros():
    m = _model(6, 128, 64, 8, seed=4)
    w = torch.full((6, 2), 0.5, dtype=torch.bfloat16, device=DEV)
    ids = torch.zeros((6, 2), dtype=torch.int32, device=DEV)  # everything goes to expert 0
    y = moe_experts(m["x"], w, ids, *_shard(m["experts"], 4, 4), expert_start=4)
    assert torch.equal(y, torch.zeros_like(y))


# gpt-oss shapes: H = I = 2880, top-4, 32 and 128 experts, expert-parallel shards, 1 to 131072 tokens.
GPU_CASES = [
    (1, 32, 0, 32), (7, 32, 0, 32), (1000, 32, 0, 32), (8192, 32, 0, 32), (8192, 32, 8, 8),
    (4096, 128, 0, 128), (2048, 128, 96, 32), (131072, 32, 0, 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,e0,n_local", GPU_CASES)
def test_fused_moe_gpu(t, e, e0, n_local):
    m = _model(t, 2880, 2880, e, seed=t + e)
    ex = _shard(m["experts"], e0, n_local)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    y = moe_experts(m["x"], w, ids, *ex, expert_start=e0)
    _check(y, moe_experts_reference(m["x"], w, ids, *ex, expert_start=e0))


GPU_MOE_VARIANTS = [
    dict(ALIGN_M=128, TMA=True,
         gate_up=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4),
         down=dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)),
    dict(ALIGN_M=64, TMA=False,
         gate_up=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3),
         down=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3)),
    dict(ALIGN_M=64, TMA=True, PREGATHER=True,
         gate_up=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4),
         down=dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)),
    dict(ALIGN_M=64, TMA=True,
         gate_up=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_N=False),
         down=dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_N=False)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_MOE_VARIANTS, ids=["tma-128", "ptr-64", "pregather-64", "unsplit-64"])
def test_fused_moe_variants_gpu(config):
    m = _model(3000, 2880, 2880, 32, seed=77)
    ex = _shard(m["experts"], 4, 16)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    y = moe_experts(m["x"], w, ids, *ex, expert_start=4, config=config)
    _check(y, moe_experts_reference(m["x"], w, ids, *ex, expert_start=4))


def test_gather_act_quant_rows_are_act_quant_of_their_tokens():
    gen = torch.Generator().manual_seed(12)
    t, k, h = 9, 3, 200
    x = (torch.randn(t, h, generator=gen) * 4).to(DEV, torch.bfloat16)
    slots = torch.tensor([4, 0, 26, t * k, 13, t * k, 7, 1], dtype=torch.int32, device=DEV)  # t*k: padding
    q, s = gather_act_quant(x, slots, k)
    qr, sr = act_quant(x)
    for r, slot in enumerate(slots.tolist()):
        if slot < t * k:
            assert torch.equal(q[r].float(), qr[slot // k].float()) and torch.equal(s[r], sr[slot // k])
        else:
            assert not q[r].float().any()
    # from the caller's act_quant(x): its rows copied, the same bits, padding rows included
    q2, s2 = gather_act_quant(x, slots, k, x_quant=(qr, sr))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    valid = slots < t * k
    assert torch.equal(s2[valid], s[valid])
    # padding rows (all-zero A, so the scale multiplies zeros): eps / 448 in both forms, to one ulp,
    # since on the GPU one form folds the constant division at compile time and the other divides
    # with the approximate fp32 division at run time (measured on the H200: they differ there)
    torch.testing.assert_close(s2[~valid], s[~valid], rtol=2.4e-7, atol=0)
    assert (s2[~valid] > 0).all()
    with pytest.raises(AssertionError, match="x_quant scale"):
        gather_act_quant(x, slots, k, x_quant=(qr, sr[:, :1]))


@pytest.mark.parametrize("t,e", [(30, 8)] + ([(1000, 32), (4096, 128)] if HAS_CUDA else []))
def test_moe_gather_from_quant_same_bits(t, e, monkeypatch):
    """GATHER_FROM_QUANT (gate_up's sorted A copied from the caller's x_quant) leaves the expert
    outputs bit for bit as they are when x is quantized again (PREGATHER configs; on the GPU the
    default one, with the Gluon gate_up)."""
    from gptoss_fp8.kernels import moe as moe_mod

    h, i = (160, 192) if t == 30 else (2880, 2880)
    m = _model(t, h, i, e, seed=t + e)
    _, ids = route(m["x"], m["wr"], m["br"], 4)
    cfg = None if HAS_CUDA else dict(
        ALIGN_M=32, TMA=True, PREGATHER=True,
        gate_up=dict(BLOCK_M=16, BLOCK_N=256, GROUP_M=2, num_warps=4, num_stages=2),
        down=dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2, num_warps=4, num_stages=2))
    xq = act_quant(m["x"])
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(moe_mod, "GATHER_FROM_QUANT", flag)
        outs.append(moe_mod.moe_expert_slots(m["x"], ids, *m["experts"], config=cfg, x_quant=xq))
    assert torch.equal(outs[0], outs[1])


def test_moe_combine_matches_einsum():
    gen = torch.Generator().manual_seed(13)
    t, k, h = 33, 4, 300
    y = torch.randn(t, k, h, generator=gen).to(DEV, torch.bfloat16)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1).to(DEV, torch.bfloat16)
    got = moe_combine(y, w).float()
    want = torch.einsum("bec,be->bc", y.float(), w.float())  # fp32 sum; both round once to bf16
    assert torch.all((got - want).abs() <= want.abs() * 2**-7 + 1e-5)
    ids = torch.randint(0, 8, (t, k), generator=gen, dtype=torch.int32).to(DEV)
    here = ((ids >= 2) & (ids < 6)).float()
    got = moe_combine(y, w, ids, 2, 4).float()
    want = torch.einsum("bec,be->bc", y.float(), w.float() * here)
    assert torch.all((got - want).abs() <= want.abs() * 2**-7 + 1e-5)


# The warp-specialized Gluon expert GEMMs (kernels/moe_ws.py, sm_90 only; the default where the
# experts' segments are 64-row aligned), forced here: each GEMM alone and both, 5 stages, a
# tensor-parallel-like shard (I = 720: the last gate_up tile's second warpgroup holds 32 of its 128
# columns; down's K has a half group) and H = 640 (down's last tile: one warpgroup idle).
def _ws_config(gate_up=True, down=True, stages=4):
    from gptoss_fp8.kernels.moe import moe_config

    ws, base = moe_config(8192, 4, 32, ws=True), moe_config(8192, 4, 32)
    ws_down = dict(WS=True, BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_stages=stages)  # not the default
    cfg = dict(ws, gate_up=dict(ws["gate_up"], num_stages=stages) if gate_up else base["gate_up"],
               down=ws_down if down else base["down"])
    assert cfg["ALIGN_M"] == 64 and cfg["PREGATHER"], cfg
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,i,e,e0,n_local,cfg", [
    (3000, 2880, 2880, 32, 4, 16, _ws_config()),
    (3000, 2880, 2880, 32, 4, 16, _ws_config(down=False)),
    (3000, 2880, 2880, 32, 4, 16, _ws_config(gate_up=False)),
    (2000, 2880, 2880, 128, 0, 128, _ws_config(stages=5)),
    (1500, 2880, 720, 16, 0, 16, _ws_config()),
    (700, 640, 1440, 8, 2, 4, _ws_config()),
], ids=["both", "gate_up", "down", "e128-5stages", "i720", "h640"])
def test_fused_moe_ws_gpu(t, h, i, e, e0, n_local, cfg):
    m = _model(t, h, i, e, seed=t + h + i)
    ex = _shard(m["experts"], e0, n_local)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    y = moe_experts(m["x"], w, ids, *ex, expert_start=e0, config=cfg)
    _check(y, moe_experts_reference(m["x"], w, ids, *ex, expert_start=e0))


def test_fused_moe_ws_refused_off_sm90():
    if HAS_CUDA:
        pytest.skip("CPU-only check of the refusal message")
    m = _model(64, 256, 256, 4, seed=3)
    w, ids = route(m["x"], m["wr"], m["br"], 4)
    with pytest.raises(AssertionError, match="WS=True needs an sm_90 GPU"):
        moe_experts(m["x"], w, ids, *m["experts"], config=_ws_config())


@pytest.mark.parametrize("fuse", [True, False], ids=["gate_up", "down"])
def test_moe_ws_compiles_for_sm90(fuse):
    """Without a GPU: both Gluon expert GEMMs compile for sm_90 into warp-specialized code
    (registers moved between partitions, fp8 wgmma, TMA loads, no local memory in the PTX)."""
    import re

    from gptoss_fp8.kernels import _gluon, moe_ws

    if not _gluon.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API; the MoE uses its Triton kernels")
    lay = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth=8, rank=2, transposed=False, "
           "fp4_padded=False, cga_layout=[])")
    types = {"a_desc": f"tensordesc<fp8e4nv[64, 128],{lay.format(128)}>",
             "b_desc": f"tensordesc<fp8e4nv[256, 128],{lay.format(128)}>",
             "out_desc": f"tensordesc<fp8e4nv[64, 64],{lay.format(64)}>" if fuse else f"tensordesc<fp8e4nv[64, 128],{lay.format(128)}>",
             "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp8e4nv" if fuse else "*bf16",
             "out_s_ptr": "*fp32" if fuse else "*bf16", "slots_ptr": "*i32", "block_expert_ptr": "*i32", "limit": "fp32"}
    consts = dict(STAGES=4, GROUP_M=8, FUSE_SWIGLU=fuse, ALPHA=1.702, FP8_MAX_C=448.0, EPS=1e-10)
    k = _gluon.compile_for_sm90(moe_ws._ws_moe_gemm_kernel, types, consts)
    ptx = k["ptx"]
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == fuse, "TMA store only for gate_up's FP8 output"
    assert ".local" not in ptx
    assert k["num_warps"] == 12 and k["shared"] <= 227 * 1024


@pytest.mark.parametrize("h", [1152, 200])
def test_zero_foreign_rows(h):
    """Slots routed outside the rank's experts are zeroed, every other row is left as it was
    (rows of NaN: nothing else written); 1152 = two 512-column chunks and a tail."""
    gen = torch.Generator().manual_seed(h)
    ids = torch.randint(0, 16, (37, 4), generator=gen, dtype=torch.int32)
    ids[:8] = 5  # whole 16-slot blocks with nothing foreign
    y = torch.full((37 * 4, h), float("nan"), dtype=torch.bfloat16)
    ids, y = ids.to(DEV), y.to(DEV)
    zero_foreign_rows(ids, y, 4, 4)
    foreign = ((ids < 4) | (ids >= 8)).reshape(-1)
    assert foreign.any() and (~foreign).any()
    assert (y[foreign] == 0).all() and y[~foreign].isnan().all()

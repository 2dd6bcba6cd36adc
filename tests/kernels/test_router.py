"""The router kernel (kernels/router.py) against plain torch.

Tolerances: logits within one bf16 ulp of the exact product + bias rounded once (summation order),
plus 1e-5 absolute: where the sum cancels to near zero, the fp32 rounding of partial sums of
magnitude ~1 dominates (measured on the H200 at 8192-32768 tokens: at most 1e-6 absolute, e.g.
-5.5e-6 for an exact -6.2e-6; every value above ~1e-3 within one ulp); ids exactly the top-k of the
kernel's own logits with ties to the lowest id, and the same
experts as ``spec.route`` (the reference) for every token whose k-th and (k+1)-th logits are more than two
ulps apart; weights within one bf16 ulp of the softmax of the selected logits.

The split form (a few tokens: H cut over programs, the last to arrive sums the partials) against
torch with the same tolerances, and against the tiled form: logits within one ulp of each other,
ids equal wherever no two of the k+1 largest logits are within two ulps; the arrival counters
zero after every call; two calls bit-identical.
"""

import pytest
import torch

from gptoss_fp8.kernels import arrival_counters
from gptoss_fp8.kernels.router import SPLIT_MAX_TOKENS, RouterSplit, router, router_config
from gptoss_fp8.spec import route as router_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ULP = 2.0**-7  # bf16 relative spacing (8 significant bits)


def _case(t, h, e, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(e, h, generator=g) / h**0.5).bfloat16()
    b = (0.1 * torch.randn(e, generator=g)).bfloat16() if bias else None
    return x.to(DEV), w.to(DEV), None if b is None else b.to(DEV)


def _within_ulp(got, want, ulps=1, atol=1e-6):
    g, w = got.float().cpu(), want.float().cpu()
    bad = (g - w).abs() > w.abs() * ulps * ULP + atol
    assert not bad.any(), f"{int(bad.sum())} values off, e.g. {g[bad][:3].tolist()} vs {w[bad][:3].tolist()}"


@pytest.mark.parametrize(
    "t,h,e,k,bias", [(37, 192, 8, 2, True), (70, 2880, 32, 4, True), (33, 2880, 128, 4, True), (20, 96, 5, 3, False)]
)
def test_router_matches_torch(t, h, e, k, bias):
    _check_router(t, h, e, k, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e", [(8192, 32), (4099, 128), (1, 32)])
def test_router_gpt_oss_shapes_gpu(t, e):
    _check_router(t, 2880, e, 4, True)


def _check_router(t, h, e, k, bias, config=None):
    x, w, b = _case(t, h, e, seed=t * e + k, bias=bias)
    logits, ids, wts = router(x, w, b, k, config=config)
    assert logits.dtype == wts.dtype == torch.bfloat16 and ids.dtype == torch.int32 and ids.shape == (t, k)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    _within_ulp(logits, exact.to(torch.bfloat16), atol=1e-5)
    # ids: the kernel's own logits sorted descending, ties to the lowest id (a stable sort)
    own = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids.long().cpu(), own.cpu())
    sel = torch.gather(logits.float(), 1, ids.long())
    _within_ulp(wts, torch.softmax(sel, dim=-1).to(torch.bfloat16))
    # the same experts as torch's router wherever the k-th choice is not a near-tie
    ref_logits, ref_ids, ref_w = router_reference(x, w, b, k)
    srt = torch.sort(ref_logits.float(), dim=-1, descending=True).values
    if k < e:
        clear = (srt[:, k - 1] - srt[:, k]) > 2 * ULP * srt[:, k - 1].abs()
    else:
        clear = torch.ones(t, dtype=torch.bool, device=x.device)
    assert t < 16 or clear.float().mean() > 0.5  # most tokens are clear cases
    same = (ids.long().sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert bool(same[clear].all()), f"{int((~same[clear]).sum())} clear tokens route differently"


def test_router_ties_go_to_the_lowest_id_and_empty_input():
    x, w, b = _case(9, 64, 8, seed=3)
    w[5] = w[2]  # experts 2 and 5 tie on every token
    w[6] = w[1]  # and 1 and 6
    b = torch.zeros_like(b)
    logits, ids, _ = router(x, w, b, 8)
    pos = {int(e): i for i, e in enumerate(ids[0].tolist())}
    assert pos[2] < pos[5] and pos[1] < pos[6]
    for r in range(9):
        assert sorted(ids[r].tolist()) == list(range(8))
    lg, ids0, w0 = router(x[:0], w, b, 4)
    assert lg.shape == (0, 8) and ids0.shape == w0.shape == (0, 4)
    with pytest.raises(AssertionError, match="top_k"):
        router(x, w, b, 9)


# (T, H, E): H = 2880 only at one token (the interpreter walks every block of every split)
SMALL = [(1, 2880, 32), (3, 320, 32), (16, 320, 32), (1, 2880, 128), (3, 320, 128), (16, 320, 128)]


@pytest.mark.parametrize("t,h,e", SMALL)
def test_router_split_matches_torch(t, h, e):
    assert isinstance(router_config(t, e, DEV == "cuda"), RouterSplit)  # the default form at this size
    _check_router(t, h, e, 4, True)


def test_router_split_ragged():
    # forced at 40 tokens (3 row tiles, the last one partial), H = 200 not a multiple of BLOCK_K = 32
    # (3 splits of 3, 3 and 1 blocks, the last one 8 wide), 5 experts in a 16-wide tile, no bias
    _check_router(40, 200, 5, 3, False, config=RouterSplit(3, 32, 4, 1))


def _agree(split, tiled, k):
    """The two forms: logits within one ulp of each other; the same ids (same order) on every token
    whose logits are equal, or whose k+1 largest logits are more than two ulps apart."""
    (ls, ids_s, _), (lt, ids_t, _) = split, tiled
    _within_ulp(ls, lt, atol=1e-5)
    top = torch.sort(lt.float(), dim=-1, descending=True).values[:, : k + 1]
    clear = ((top[:, :-1] - top[:, 1:]) > 2 * ULP * top[:, :-1].abs()).all(-1)
    clear |= (ls == lt).all(-1)
    assert clear.any()
    same = (ids_s == ids_t).all(-1)
    assert bool(same[clear].all()), f"{int((~same[clear]).sum())} clear tokens route differently"


def _check_split(t, h, e, config=None):
    """The split form (router_config's or ``config``) against the tiled form; two calls
    bit-identical; the counters back at zero."""
    x, w, b = _case(t, h, e, seed=7 * t + e)
    on_gpu = DEV == "cuda"
    config = config or router_config(min(t, SPLIT_MAX_TOKENS), e, on_gpu)
    assert isinstance(config, RouterSplit)
    split = router(x, w, b, 4, config=config)
    _agree(split, router(x, w, b, 4, config=router_config(t, e, on_gpu, split=False)), 4)
    again = router(x, w, b, 4, config=config)
    for a, c in zip(split, again, strict=True):
        assert torch.equal(a, c)
    assert int(arrival_counters(x.device, 1).count_nonzero()) == 0


@pytest.mark.parametrize("t,h,e", [(16, 320, 32), (16, 320, 128), (1, 2880, 32)])
def test_router_split_agrees_with_tiled(t, h, e):
    _check_split(t, h, e)


def test_router_split_several_tiles_agrees_with_tiled():
    _check_split(40, 320, 32, config=RouterSplit(4, 64, 4, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
@pytest.mark.parametrize("e", [32, 128])
def test_router_small_t_gpu(t, e):
    _check_router(t, 2880, e, 4, True)  # router_config's form
    _check_router(t, 2880, e, 4, True, config=router_config(min(t, SPLIT_MAX_TOKENS), e, True))
    _check_split(t, 2880, e)


@pytest.mark.gpu
@pytest.mark.parametrize("e", [32, 128])
def test_router_split_in_a_cuda_graph_gpu(e):
    x, w, b = _case(1, 2880, e, seed=11)
    router(x, w, b, 4)  # compiles, and allocates the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = router(x, w, b, 4)
    for seed in (12, 13):
        x.copy_(_case(1, 2880, e, seed=seed)[0])
        graph.replay()
        want = router(x, w, b, 4)
        for a, c in zip(got, want, strict=True):
            assert torch.equal(a, c)
    torch.cuda.synchronize()
    assert int(arrival_counters(x.device, 1).count_nonzero()) == 0


def _norm_source(t, h, seed):
    """A post-attention norm's source: the new stream x, its rows as the norm kernel writes them, each row's rsqrt
    factor (``rms_norm_quant(rstd=)``, rows and rsqrt from one launch) and the norm weight."""
    from gptoss_fp8.kernels.norm import rms_norm_quant

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 3).bfloat16().to(DEV)
    d = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    nw = (torch.rand(h, generator=g) + 0.5).to(DEV)
    rstd = torch.full((t,), float("nan"), device=DEV)
    xo, y, _ = rms_norm_quant(x, d, nw, 1e-5, rstd=rstd)
    return xo, y, rstd, nw


@pytest.mark.parametrize("t,h,e,config", [(5, 200, 32, None), (40, 320, 32, None), (40, 320, 128, RouterSplit(4, 64, 4, 1)),
                                          (70, 2880, 32, None)], ids=["split", "tiles", "split-tiles", "2880"])
def test_router_remakes_the_norms_rows(t, h, e, config):
    """``router(norm=(rstd, weight))`` on the stream before the norm: the rows remade as the product reads them are
    the norm kernel's bit for bit, so logits, ids and weights equal those of ``router`` on the rows (both forms,
    H with and without a partial 64-column block); the norm's rsqrt factors are torch's within float32 rounding."""
    xo, y, rstd, nw = _norm_source(t, h, seed=t + h + e)
    _, w, b = _case(t, h, e, seed=e)
    want = router(y, w, b, 4, config=config)
    got = router(xo, w, b, 4, config=config, norm=(rstd, nw))
    assert all(torch.equal(a, c) for a, c in zip(want, got, strict=True))
    torch.testing.assert_close(rstd, torch.rsqrt(xo.float().pow(2).mean(-1) + 1e-5), rtol=2e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e", [(32768, 32), (4099, 128), (1, 32)])
def test_router_remakes_the_norms_rows_gpu(t, e):
    xo, y, rstd, nw = _norm_source(t, 2880, seed=t + e)
    _, w, b = _case(t, 2880, e, seed=e)
    want, got = router(y, w, b, 4), router(xo, w, b, 4, norm=(rstd, nw))
    assert all(torch.equal(a, c) for a, c in zip(want, got, strict=True))

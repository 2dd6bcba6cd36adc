"""The model API the runtime needs, against the existing paths bit for bit on CPU (weights mode):
a prompt prefilled in chunks (``prefill(start=)``) equals it prefilled at once, and a decode step
over a prefix of a cache's sequences (``KVCache.prefix``) equals the step over the whole cache."""

import pytest
import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.backends import get_ops


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.model.load import load_model

    root = tmp_path_factory.mktemp("chunks")
    # a short sliding window so that chunks cross a wrapped ring
    write_synthetic(root / "src", "tiny", seed=5, layout="hf", sliding_window=8)
    convert_checkpoint(root / "src", root / "fp8")
    return load_model(root / "fp8")


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_equals_whole_prefill(model, chunk):
    ops = get_ops("weights")
    torch.manual_seed(chunk)
    prompt = torch.randint(0, model.cfg.vocab_size - 8, (29,))
    whole, want = model.prefill(prompt, ops, max_len=40)
    cache = model.new_cache(40, batch=2)
    model.prefill(torch.randint(0, 100, (5,)), ops, cache=cache, row=0)  # another sequence in row 0
    for s in range(0, 29, chunk):
        _, got = model.prefill(prompt[s:s + chunk], ops, cache=cache, row=1, start=s)
    assert cache.host_lengths == [5, 29] and cache.lengths.tolist() == [5, 29]
    assert torch.equal(got, want)
    for i in range(len(cache.k)):  # every layer's K / V, rings included
        assert torch.equal(cache.k[i][1], whole.k[i][0]) and torch.equal(cache.v[i][1], whole.v[i][0])
    # and the decode after it
    assert torch.equal(model.decode(cache.prefix(2), torch.tensor([3, 4]), ops)[1], model.decode(whole, 4, ops)[0])


def test_a_chunk_continues_where_the_sequence_ends(model):
    ops = get_ops("weights")
    cache = model.new_cache(16)
    model.prefill(torch.arange(4), ops, cache=cache)
    with pytest.raises(GptOssFp8Error, match="sequence 0 holds 4 tokens"):
        model.prefill(torch.arange(4), ops, cache=cache, start=5)
    with pytest.raises(GptOssFp8Error, match="max_len 16"):
        model.prefill(torch.arange(14), ops, cache=cache, start=4)


@pytest.mark.parametrize("mode", ["weights", "w8a8"])
def test_decode_of_a_prefix_is_the_whole_caches_rows(model, mode):
    """Rows 0..b-1 of a step over b sequences equal the same rows of a step over all of them:
    the runtime's decode batches are prefixes of its slots."""
    ops = get_ops(mode)
    torch.manual_seed(1)
    a, b = model.new_cache(32, batch=4), model.new_cache(32, batch=4)
    for r, n in enumerate([5, 9, 3, 12]):
        p = torch.randint(0, 400, (n,))
        model.prefill(p, ops, cache=a, row=r)
        model.prefill(p, ops, cache=b, row=r)
    tok = torch.tensor([7, 8, 9, 10])
    full = model.decode(a, tok, ops)
    view = b.prefix(2)
    part = model.decode(view, tok[:2], ops)
    assert torch.equal(part, full[:2])
    assert b.lengths.tolist() == [6, 10, 3, 12] and view.host_lengths == [6, 10]  # the rest untouched
    for i in range(len(a.k)):
        assert torch.equal(a.k[i][:2], b.k[i][:2])


def _same(got: torch.Tensor, want: torch.Tensor, mode: str) -> None:
    """Bit for bit in weights mode. w8a8's fp32 GEMMs (``block_gemm_dequantized``) may sum in another order where
    CPU BLAS picks its kernel by row count (on the GPU machine's 16-core CPU a cache's V moved, its K and logits not),
    and an activation's e4m3 rounding can flip after it: there, nine in ten values bit for bit and the rest
    within a few of e4m3's steps (a chunk at a wrong row or offset moves nearly every value)."""
    if mode == "weights":
        assert torch.equal(got, want)
        return
    assert (got == want).float().mean() >= 0.9
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("mode", ["weights", "w8a8"])
def test_prefill_many_equals_each_chunk_alone(model, mode):
    """Several sequences' chunks in one forward (the engine's prompts of a step: ``prefill_many``)
    give each chunk's logits and K / V as its own prefill does (bit for bit; w8a8: ``_same``): two fresh
    prompts, one continuing after 11 cached tokens (crossing the 8-token ring), in rows 3, 0, 2."""
    ops = get_ops(mode)
    torch.manual_seed(7)
    v = model.cfg.vocab_size
    first = torch.randint(0, v, (11,))
    chunks = [(3, torch.randint(0, v, (6,)), 0), (0, torch.randint(0, v, (13,)), 0), (2, torch.randint(0, v, (9,)), 11)]
    alone, many = model.new_cache(32, batch=4), model.new_cache(32, batch=4)
    for c in (alone, many):
        model.prefill(first, ops, cache=c, row=2)
    want = torch.cat([model.prefill(t, ops, cache=alone, row=r, start=s)[1] for r, t, s in chunks])
    got = model.prefill_many(chunks, ops, many)
    _same(got, want, mode)
    assert many.host_lengths == alone.host_lengths == [13, 0, 20, 6]
    for i in range(len(many.k)):
        _same(many.k[i], alone.k[i], mode)
        _same(many.v[i], alone.v[i], mode)
    with pytest.raises(GptOssFp8Error, match="sequences \\[1, 1\\] repeat"):
        model.prefill_many([(1, first, 0), (1, first, 0)], ops, many)
    with pytest.raises(GptOssFp8Error, match="sequence 0 holds 13 tokens"):
        model.prefill_many([(0, first, 5), (1, first, 0)], ops, many)


@pytest.fixture(scope="module")
def window_last(tmp_path_factory):
    """Three layers: the last a sliding-window one (its pruned row runs the chunk attention, not the decode one)."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic
    from gptoss_fp8.model.load import load_model

    root = tmp_path_factory.mktemp("chunks3")
    write_synthetic(root / "src", "tiny", layers=3, seed=6, layout="hf", sliding_window=8)
    convert_checkpoint(root / "src", root / "fp8")
    m = load_model(root / "fp8")
    assert m.cfg.layer_types[-1] == "sliding_attention"
    return m


@pytest.mark.parametrize("mode,which", [("weights", "full"), ("w8a8", "full"), ("weights", "window")])
def test_last_layer_on_the_returned_rows_only(model, window_last, mode, which):
    """A prefill's last layer computes past its K / V only the rows whose logits it returns
    (``GptOss.prune_last_layer``): the same logits and caches as every row computed (the CPU
    ops' rows do not depend on the other rows: bit for bit in weights mode, ``_same`` in w8a8),
    one sequence and several chunks in one forward (one after 11 cached keys, past the 8-key
    ring); forward's last row agrees too. The last layer a full one, or a sliding-window one."""
    model = model if which == "full" else window_last
    ops = get_ops(mode)
    torch.manual_seed(11)
    v = model.cfg.vocab_size
    prompt = torch.randint(0, v, (21,))
    first = torch.randint(0, v, (11,))
    chunks = [(1, torch.randint(0, v, (6,)), 0), (0, torch.randint(0, v, (13,)), 11)]
    got, rows = {}, []
    ffn = ops.expert_ffn
    ops.expert_ffn = lambda x, *a, **kw: (rows.append(x.shape[0]), ffn(x, *a, **kw))[1]  # the MoE's rows per layer
    for prune in (True, False):
        model.prune_last_layer = prune
        try:
            cache, last = model.prefill(prompt, ops, max_len=32)
            many = model.new_cache(32, batch=2)
            model.prefill(first, ops, cache=many, row=0)
            got[prune] = (cache, last, many, model.prefill_many(chunks, ops, many),
                          model.forward(prompt, ops, last_only=True))
        finally:
            model.prune_last_layer = True
    n = len(model.model.layers)
    pruned = [m for k in (21, 11) for m in [k] * (n - 1) + [1]] + [19] * (n - 1) + [2] + [21] * (n - 1) + [1]
    assert rows[:4 * n] == pruned and rows[4 * n:] == [21] * n + [11] * n + [19] * n + [21] * n
    (c1, l1, m1, p1, f1), (c0, l0, m0, p0, f0) = got[True], got[False]
    assert l1.shape == (1, v) and p1.shape == (2, v)
    for a, b in ((l1, l0), (p1, p0), (f1, f0)):
        _same(a, b, mode)
    _same(l1, model.forward(prompt, ops)[-1:], mode)
    for i in range(len(c1.k)):  # every layer's K / V, the last included
        for a, b in ((c1.k[i], c0.k[i]), (c1.v[i], c0.v[i]), (m1.k[i], m0.k[i]), (m1.v[i], m0.v[i])):
            _same(a, b, mode)
    assert m1.host_lengths == m0.host_lengths == [24, 6]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_rows_write_and_read_as_each_chunk_does(seed):
    """``KVCache.chunk_rows`` / ``write_chunks`` / ``chunk_keys`` (a step's chunks in a few copies a layer) against
    ``write`` / ``read`` chunk by chunk: random chunks (fresh, after cached keys, longer than the ring, wrapping it)
    on a full layer and a ring of 8, the same cache rows, and each chunk's keys where ``starts`` / ``offsets`` say."""
    from gptoss_fp8.model.cache import KVCache

    gen = torch.Generator().manual_seed(seed)
    rope = (torch.zeros(64, 4), torch.zeros(64, 4))
    a, b = (KVCache.empty([0, 8], 2, 8, 64, rope, batch=5) for _ in range(2))
    for t in (*a.k, *a.v):  # earlier tokens, the same in both
        t.copy_(torch.randn(t.shape, generator=gen))
    b.k = [t.clone() for t in a.k]
    b.v = [t.clone() for t in a.v]
    slots = torch.randperm(5, generator=gen)[:4].tolist()
    chunks = [(s, int(torch.randint(0, 30, (1,), generator=gen)) * (j % 3 != 0), int(torch.randint(1, 20, (1,),
              generator=gen))) for j, s in enumerate(slots)]
    t = sum(n for _, _, n in chunks)
    k, v = torch.randn(t, 2, 8, generator=gen).bfloat16(), torch.randn(t, 2, 8, generator=gen).bfloat16()
    for i in (0, 1):
        plan = a.chunk_rows(i, chunks)
        assert plan.dst.unique().numel() == plan.dst.numel()  # no row written twice (a GPU's order is not fixed)
        ka, va = a.chunk_keys(i, plan, k, v) if plan.packed else (None, None)
        a.write_chunks(i, plan, k, v)
        if not plan.packed:
            ka, va = a.chunk_keys(i, plan, k, v)
        r0 = 0
        for j, (s, pos0, n) in enumerate(chunks):
            pk, pv, first = b.read(i, s, pos0) if pos0 else (k[:0], v[:0], pos0)
            want_k, want_v = torch.cat([pk, k[r0:r0 + n]]), torch.cat([pv, v[r0:r0 + n]])
            b.write(i, s, pos0, k[r0:r0 + n], v[r0:r0 + n])
            k0, off = plan.starts[j], plan.offsets[j]
            assert off == pos0 - first
            if plan.packed:
                assert torch.equal(ka[k0:k0 + off + n], want_k) and torch.equal(va[k0:k0 + off + n], want_v)
            r0 += n
        if not plan.packed:  # a full layer: keys read from the cache after the writes
            for j, (s, pos0, n) in enumerate(chunks):
                k0 = plan.starts[j]
                want_k, want_v, _ = b.read(i, s, pos0 + n)
                assert torch.equal(ka[k0:k0 + pos0 + n], want_k) and torch.equal(va[k0:k0 + pos0 + n], want_v)
        assert torch.equal(a.k[i], b.k[i]) and torch.equal(a.v[i], b.v[i])

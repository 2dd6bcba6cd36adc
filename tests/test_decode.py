"""KV-cached decode against the full-sequence forward, token by token (CPU backends).

Prefill all but the last N tokens, decode those N one at a time, and compare each step's logits
with the same backend's full forward at that position. Decode and forward run the same code
(model/gptoss.py ``_run`` / ``_attention``); what differs is (a) the attention reads the cache's
keys (only the visible ones: a ring of ``sliding_window`` rows on sliding layers) instead of a
masked T x T score matrix, and (b) every GEMM runs on 1 row instead of T. (a) is exact on CPU (the
masked columns are exp(-inf) = 0); (b) changes the fp32 accumulation order of the w8a8 block GEMM
(measured: layer 0's q_proj on an identical input row differs by one bf16 rounding, 2e-3), and a
one-ulp change can flip a downstream FP8 activation rounding (e4m3: 1/16 relative), so w8a8 logits
move by a few bf16 ulps of the logit scale. Measured on the tiny preset (synthetic seeds 7, 11, 3;
T = 40; prefill 16 and 5): ``weights`` 0 at every step (bitwise equal); ``w8a8`` relative L2 error
<= 1.4e-2 (max |diff| up to 0.52 on logits of |max| ~22, std ~5.6, from one flipped FP8 rounding).
Tolerance per step, relative L2: ``weights`` 2^-8 (one bf16 ulp), ``w8a8`` 3e-2 (~2x the largest
measured). Each injected decode bug gives 0.15 (ring, stale K) to 0.43 (RoPE) at the step where it
first acts, > 2x the tolerance, with every earlier step within it.
"""

import pytest
import torch

from gptoss_fp8.convert.convert import convert_checkpoint
from gptoss_fp8.convert.synth import write_synthetic
from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.model.cache import KVCache
from gptoss_fp8.model.gptoss import GptOss
from gptoss_fp8.model.load import load_model

T, N = 40, 24  # prefill 16 tokens (the ring of 8 is already full), then 24 decode steps
# relative L2 error of one step's logits (see the module docstring): weights one bf16 ulp (2^-8),
# w8a8 ~2x the largest measured
TOLS = {"weights": 2.0**-8, "w8a8": 3e-2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    cfg = write_synthetic(root / "src", "tiny", seed=7, layout="hf")
    convert_checkpoint(root / "src", root / "fp8")
    model = load_model(root / "fp8")
    assert cfg.sliding_window < N and "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1234))
    assert tokens.unique().numel() > T // 2
    full = {mode: model(tokens, get_ops(mode)).float() for mode in ("weights", "w8a8")}
    return cfg, model, tokens, full


def _decode_errors(model: GptOss, tokens: torch.Tensor, full: torch.Tensor, ops, prefill: int = T - N) -> list[float]:
    """Relative L2 error of each logits row (the prefill's last, then each decode step's) against
    the full forward at the same position."""
    cache, last = model.prefill(tokens[:prefill], ops, max_len=tokens.shape[0])
    assert cache.length == prefill
    rows = [last]
    for p in range(prefill, tokens.shape[0]):
        rows.append(model.decode(cache, tokens[p], ops))
        assert cache.length == p + 1
    got = torch.cat(rows).float()
    want = full[prefill - 1:]
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()


def _first_bad(errs: list[float], tol: float) -> int | None:
    """The first failing decode step (0 = the first decoded token), or None; -1: the prefill."""
    bad = [i for i, e in enumerate(errs) if e > tol]
    return bad[0] - 1 if bad else None


@pytest.mark.parametrize("mode", ["weights", "w8a8"])
def test_decode_matches_forward(tiny, mode):
    cfg, model, tokens, full = tiny
    errs = _decode_errors(model, tokens, full[mode], get_ops(mode))
    assert len(errs) == N + 1
    assert _first_bad(errs, TOLS[mode]) is None, f"{mode}: step errors {errs}"
    if mode == "weights":  # the bf16 path is exact on CPU: same GEMMs per row, masked columns are zeros
        assert max(errs) == 0.0, errs


@pytest.mark.parametrize("prefill", [1, 5])
def test_decode_from_a_short_prefill_fills_and_wraps_the_ring(tiny, prefill):
    """A prompt shorter than the window: the ring fills during decode, then wraps."""
    cfg, model, tokens, full = tiny
    errs = _decode_errors(model, tokens, full["w8a8"], get_ops("w8a8"), prefill)
    assert _first_bad(errs, TOLS["w8a8"]) is None, errs


def test_cache_holds_only_the_window(tiny):
    cfg, model, tokens, _ = tiny
    cache, _ = model.prefill(tokens[:T - N], get_ops("weights"), max_len=T)
    for i, kind in enumerate(cfg.layer_types):
        rows = cfg.sliding_window if kind == "sliding_attention" else T
        assert cache.k[i].shape == cache.v[i].shape == (rows, cfg.num_key_value_heads, cfg.head_dim)
        assert cache.k[i].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# Injected decode-only bugs: each must fail the comparison, at the step it first acts


def _ring_one_short(window):  # a ring of window - 1 rows: the oldest visible key is overwritten
    return window - 1


def _rope_at_zero(self, cache, pos):  # the new token rotated as position 0, not its absolute position
    return cache.rope_rows(0, 1)


_write = KVCache.write


def _stale_k(self, i, pos0, k, v):  # decode does not store the new K: the row keeps what it held
    if k.shape[0] == 1:
        k = self.k[i][self.slot(i, torch.tensor([pos0]))]
    _write(self, i, pos0, k, v)


def _no_sinks(ops):
    attn = ops.attention_cached

    def dropped(q, k, v, sinks, sm_scale, window, q_offset):
        return attn(q, k, v, torch.full_like(sinks, -float("inf")), sm_scale, window, q_offset)

    ops.attention_cached = dropped
    return ops


@pytest.mark.parametrize("mode", ["weights", "w8a8"])
@pytest.mark.parametrize("bug,prefill,step", [
    # prefill 5 < window 8: the one-short ring first loses a visible key at position 7 (step 2)
    ("ring_off_by_one", 5, 2),
    ("rope_position_0", T - N, 0),
    ("stale_k", T - N, 0),
    ("sinks_dropped", 1, 0),  # 2 keys visible at step 0: the sink's share of the softmax is largest
])
def test_injected_decode_bug_fails_at_its_step(tiny, monkeypatch, mode, bug, prefill, step):
    cfg, model, tokens, full = tiny
    ops = get_ops(mode)
    if bug == "ring_off_by_one":
        monkeypatch.setattr(KVCache, "ring_size", staticmethod(_ring_one_short))
    elif bug == "rope_position_0":
        monkeypatch.setattr(GptOss, "_rope_at", _rope_at_zero)
    elif bug == "stale_k":
        monkeypatch.setattr(KVCache, "write", _stale_k)
    else:
        ops = _no_sinks(ops)
    errs = _decode_errors(model, tokens, full[mode], ops, prefill)
    first = _first_bad(errs, TOLS[mode])
    assert first == step, f"{bug} ({mode}): first failing step {first}, errors {errs}"
    assert errs[step + 1] > 2 * TOLS[mode], errs

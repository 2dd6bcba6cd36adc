"""gptoss_fp8/hf_attention.py: our attention kernels behind transformers' ``AttentionInterface``,
run here through Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py) on CPU tensors,
against transformers' own eager attention; the masks it gets; and that ``gptoss_fp8.hf`` selects
it for the FP8-resident CUDA load only."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

import gptoss_fp8.hf as ghf  # noqa: E402
from gptoss_fp8 import hf_attention as ha  # noqa: E402
from gptoss_fp8 import spec  # noqa: E402

# the kernels' cases launch on CPU tensors, which only Triton's interpreter takes (tests/conftest.py sets it where no
# GPU is visible); on a GPU machine they would hand CPU pointers to compiled kernels: tests/test_hf_gpu.py covers that
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test on CPU tensors (a GPU is "
                                      "visible); tests/test_hf_gpu.py runs the kernels on the GPU")


def _module(hq=8, hkv=2, seed=0):
    """What eager_attention_forward reads from GptOssAttention: the GQA group, the sinks, training."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    m.num_key_value_groups = hq // hkv
    m.sinks = torch.nn.Parameter(torch.randn(hq, generator=g), requires_grad=False)
    return m.eval()


def _qkv(b, hq, hkv, tq, tk, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g).bfloat16()
    k = torch.randn(b, hkv, tk, d, generator=g).bfloat16()
    v = torch.randn(b, hkv, tk, d, generator=g).bfloat16()
    return q, k, v


def _masks(config, b, tq, past, attention_mask=None):
    """transformers' masks for a GptOss step of tq new tokens after ``past`` cached ones, built as
    GptOssModel.forward builds them (``config._attn_implementation`` picks the mask function)."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cache = DynamicCache(config=config)
    if past:  # fill every layer's cache with `past` tokens
        for i in range(config.num_hidden_layers):
            z = torch.zeros(b, config.num_key_value_heads, past, config.head_dim, dtype=torch.bfloat16)
            cache.update(z, z, i)
    emb = torch.zeros(b, tq, config.hidden_size, dtype=torch.bfloat16)
    kw = dict(config=config, inputs_embeds=emb, attention_mask=attention_mask, past_key_values=cache,
              position_ids=torch.arange(past, past + tq)[None])
    return create_causal_mask(**kw), create_sliding_window_causal_mask(**kw)


def _config(impl, window=32):
    from transformers import GptOssConfig

    c = GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     sliding_window=window, layer_types=["sliding_attention", "full_attention"], vocab_size=64,
                     num_local_experts=4, intermediate_size=64)
    c._attn_implementation = impl
    return c


def _eager(module, q, k, v, m, window, dtype=None):
    """transformers' eager attention (in ``dtype``: float32 for the reference)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    if dtype is not None:
        module = types.SimpleNamespace(num_key_value_groups=module.num_key_value_groups,
                                       sinks=module.sinks.to(dtype), training=False)
        q, k, v, m = q.to(dtype), k.to(dtype), v.to(dtype), None if m is None else m.to(dtype)
    return eager_attention_forward(module, q, k, v, m, scaling=q.shape[-1] ** -0.5, dropout=0.0,
                                   sliding_window=window, s_aux=module.sinks)[0]


# --- the masks ------------------------------------------------------------------------------------


def test_sliding_window_of_reads_transformers_mask_function():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
        sliding_window_overlay,
    )

    assert ha.sliding_window_of(sliding_window_causal_mask_function(128)) == 128
    assert ha.sliding_window_of(causal_mask_function) is None
    assert ha.sliding_window_of(and_masks(causal_mask_function, sliding_window_overlay(128))) is None  # order differs
    assert ha.sliding_window_of(and_masks(sliding_window_overlay(8), causal_mask_function, causal_mask_function)) is None
    assert ha.sliding_window_of(chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))) is None


@pytest.mark.parametrize("tq,past", [(40, 0), (1, 20), (1, 50), (3, 50)])
def test_plain_masks_are_not_materialized_and_equal_eager_when_they_are(tq, past):
    """No padding: both layer types get a PlainMask with transformers' sizes (the sliding cache
    keeps window - 1 keys); materialized it is eager's mask, element for element."""
    full, slide = _masks(_config(ha.NAME), 1, tq, past, attention_mask=torch.ones(1, past + tq, dtype=torch.long))
    efull, eslide = _masks(_config("eager"), 1, tq, past, attention_mask=torch.ones(1, past + tq, dtype=torch.long))
    assert isinstance(full, ha.PlainMask) and isinstance(slide, ha.PlainMask)
    assert (full.q_length, full.kv_length, full.window) == (tq, past + tq, 0)
    assert (slide.q_length, slide.kv_length, slide.window) == (tq, min(past, 31) + tq, 32)
    assert torch.equal(full.materialize(), efull) and torch.equal(slide.materialize(), eslide)


def test_padding_gets_eagers_mask():
    am = torch.ones(2, 30, dtype=torch.long)
    am[1, :5] = 0  # left padding in row 1
    full, slide = _masks(_config(ha.NAME), 2, 30, 0, attention_mask=am)
    efull, eslide = _masks(_config("eager"), 2, 30, 0, attention_mask=am)
    assert isinstance(full, torch.Tensor) and torch.equal(full, efull) and torch.equal(slide, eslide)


# --- the attention function against eager --------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("b,t,window", [(1, 80, 0), (1, 80, 32), (2, 48, 16)])
def test_prefill_kernel_matches_eager(b, t, window):
    """Tq == Tk on a PlainMask: attention_prefill (interpreter), within bf16 output rounding of
    eager in float32 on the same bf16 inputs (sinks, GQA 4, window), and of our fp32 spec."""
    module = _module()
    q, k, v = _qkv(b, 8, 2, t, t)
    full, slide = _masks(_config(ha.NAME, window or 32), b, t, 0)
    m = slide if window else full
    ha.CALLS.clear()
    got, w = ha.attention_forward(module, q, k, v, m, scaling=64 ** -0.5, sliding_window=window or None,
                                  s_aux=module.sinks)
    assert ha.CALLS["prefill"] == 1 and w is None and got.shape == (b, t, 8, 64) and got.dtype == torch.bfloat16
    ref = _eager(module, q, k, v, m.materialize(), window or None, torch.float32)
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)
    for i in range(b):
        want = spec.attention(q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), module.sinks,
                              64 ** -0.5, window, dtype=torch.float32)
        torch.testing.assert_close(got[i].float(), want.float(), atol=1e-2, rtol=1e-2)
    eager = _eager(module, q, k, v, m.materialize(), window or None)
    print(f"b {b} t {t} window {window}: max |ours - fp32| {(got.float() - ref).abs().max().item():.3g}, "
          f"|eager bf16 - fp32| {(eager.float() - ref).abs().max().item():.3g}")


@interpreter_only
@pytest.mark.parametrize("b,tq,past,window", [(1, 1, 70, 0), (1, 1, 70, 32), (2, 1, 20, 32), (1, 3, 70, 32)])
def test_decode_kernel_matches_eager(b, tq, past, window):
    """Tq < Tk (transformers' cache: the sliding layers hold window - 1 past keys):
    attention_decode on the cache tensors as they are, against eager in float32."""
    module = _module(seed=1)
    full, slide = _masks(_config(ha.NAME, window or 32), b, tq, past)
    m = slide if window else full
    q, k, v = _qkv(b, 8, 2, tq, m.kv_length, seed=2)
    ha.CALLS.clear()
    got, _ = ha.attention_forward(module, q, k, v, m, scaling=64 ** -0.5, sliding_window=window or None,
                                  s_aux=module.sinks)
    assert ha.CALLS["decode"] == 1 and got.shape == (b, tq, 8, 64)
    ref = _eager(module, q, k, v, m.materialize(), window or None, torch.float32)
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


@interpreter_only
def test_what_the_kernels_cannot_take_is_eager_exactly():
    """Padding (a tensor mask), float32, training and a long chunk against a cache: transformers'
    eager, bit for bit, each counted with its reason."""
    module = _module()
    q, k, v = _qkv(2, 8, 2, 30, 30)
    am = torch.ones(2, 30, dtype=torch.long)
    am[1, :5] = 0
    full, _ = _masks(_config(ha.NAME), 2, 30, 0, attention_mask=am)
    ha.CALLS.clear()
    ha.FALLBACKS.clear()
    got, _ = ha.attention_forward(module, q, k, v, full, scaling=64 ** -0.5, s_aux=module.sinks)
    assert torch.equal(got, _eager(module, q, k, v, full, None))
    plain, _ = _masks(_config(ha.NAME), 2, 30, 0)
    got, _ = ha.attention_forward(module, q.float(), k.float(), v.float(), plain, scaling=64 ** -0.5, s_aux=module.sinks)
    assert torch.equal(got, _eager(module, q.float(), k.float(), v.float(), plain.materialize(), None))
    module.train()
    got, _ = ha.attention_forward(module, q, k, v, plain, scaling=64 ** -0.5, s_aux=module.sinks)
    assert torch.equal(got, _eager(module, q, k, v, plain.materialize(), None))
    module.eval()
    chunk, _ = _masks(_config(ha.NAME), 1, 20, 10)
    q2, k2, v2 = _qkv(1, 8, 2, 20, 30)
    got, _ = ha.attention_forward(module, q2, k2, v2, chunk, scaling=64 ** -0.5, s_aux=module.sinks)
    assert torch.equal(got, _eager(module, q2, k2, v2, chunk.materialize(), None))
    assert ha.CALLS == {"eager": 4} and ha.FALLBACKS == {"mask": 1, "dtype": 1, "training": 1, "chunk": 1}


# --- selection in gptoss_fp8.hf -------------------------------------------------------------------


def test_kernel_attention_only_on_cuda():
    assert ghf.kernel_attention_device(torch.device("cuda", 0)) and ghf.kernel_attention_device("cuda")
    assert not ghf.kernel_attention_device(torch.device("cpu")) and not ghf.kernel_attention_device("meta")


def _resident(monkeypatch, path, attention_device: bool):
    """from_pretrained(path) FP8-resident on CPU (our w8a8 spec ops), as if its device were CUDA for
    the attention choice when ``attention_device``."""
    from transformers import AutoModelForCausalLM

    from gptoss_fp8.model.backends import get_ops

    monkeypatch.setattr(ghf, "wants_fp8_resident", lambda device_map: True)
    monkeypatch.setattr(ghf, "fp8_ops", lambda device: get_ops("w8a8-cpu"))
    if attention_device:
        monkeypatch.setattr(ghf, "kernel_attention_device", lambda device: True)
    return AutoModelForCausalLM.from_pretrained(str(path))


@interpreter_only
@pytest.mark.slow  # ~55 s on the 2-core box: the trained fixture through the interpreter (prefill + 4 x 39 decode calls)
def test_selected_for_the_resident_load_only_and_runs_the_kernels(trained, monkeypatch):
    """The dequantized (CPU) load and the FP8-resident load on CPU keep eager; the FP8-resident
    load on a device our kernels take (CUDA; here faked, the kernels in the interpreter) selects
    ours: the prefill and every decode step on our kernels, greedy tokens equal to eager's on the
    same model, past the sliding window (64), logits within the fp32-vs-bf16 softmax difference."""
    from transformers import AutoModelForCausalLM

    dst, _, tokens, _ = trained
    assert AutoModelForCausalLM.from_pretrained(str(dst)).config._attn_implementation == "eager"
    eager = _resident(monkeypatch, dst, False)
    assert eager.config._attn_implementation == "eager"
    ours = _resident(monkeypatch, dst, True)
    assert ours.config._attn_implementation == ha.NAME
    ha.CALLS.clear()
    ha.FALLBACKS.clear()
    with torch.no_grad():
        a = eager(tokens[None]).logits[0].float()
        b = ours(tokens[None]).logits[0].float()
        assert ha.CALLS == {"prefill": 4}
        prompt = tokens[None, :40]
        ga = eager.generate(prompt, max_new_tokens=40, do_sample=False)[0, 40:]
        gb = ours.generate(prompt, max_new_tokens=40, do_sample=False)[0, 40:]
    assert ha.CALLS == {"prefill": 8, "decode": 4 * 39} and not ha.FALLBACKS
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"trained, w8a8 spec ops: our attention vs eager: max |logit diff| {(a - b).abs().max().item():.3g}, "
          f"argmax equal {agree:.1%}; greedy 40 tokens equal: {torch.equal(ga, gb)}")
    assert agree >= 0.95
    assert torch.equal(ga, gb)

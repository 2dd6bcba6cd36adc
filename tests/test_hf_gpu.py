"""``import gptoss_fp8.hf`` on a GPU: ``from_pretrained(DST, device_map="cuda")`` keeps the weights FP8
and runs them on our kernels (gptoss_fp8/hf.py, ``Fp8Linear`` / ``Fp8Experts`` on ``TritonOps``).

Every test here is marked ``gpu`` (skipped without CUDA); none has been run yet (written on a
CPU-only box: the CPU tests in test_hf.py cover the same modules on the w8a8 spec and on the
kernels through Triton's interpreter). Run on the H200:

    python -m pytest -q -s tests/test_hf_gpu.py                       # trained fixture + 2-layer 20b
    GPTOSS_FP8_HF_LAYERS=24 python -m pytest -q -s tests/test_hf_gpu.py -k synthetic   # the whole 20b

The synthetic case prints resident memory, prefill (8192 tokens) and one decode step for the FP8
model beside transformers' bf16 GptOss in the same process; compare with
``gptoss-fp8 bench prefill --model 20b --tokens 8192 --layers N`` and
``gptoss-fp8 bench decode --model 20b --batch 1 --context 8192``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("transformers")

import gptoss_fp8.hf as ghf  # noqa: E402
from gptoss_fp8 import hf_attention as ha  # noqa: E402

pytestmark = pytest.mark.gpu


def _hf(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), **kw)


def _sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def test_trained_fp8_resident_on_our_kernels(trained):
    """The trained fixture on CUDA: FP8 parameters on the GPU, every FP8 linear and expert FFN on
    a kernel (no spec fallback), and logits no further from our ``kernels`` mode than that mode is
    from our ``weights`` mode (activation quantization noise; tests/test_hf.py measures 0.58 vs
    0.80 for the kernels through the interpreter on the tiny case)."""
    from gptoss_fp8.model.backends import get_ops
    from gptoss_fp8.model.load import load_model

    dst, _, tokens, _ = trained
    model = _hf(dst, device_map="cuda")
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts, ghf.Fp8Experts) and isinstance(layer.self_attn.q_proj, ghf.Fp8Linear)
    assert model.config._attn_implementation == ha.NAME
    w = layer.mlp.experts.gate_up_proj
    assert w.dtype == torch.float8_e4m3fn and w.device.type == "cuda"
    ops = layer.mlp.experts.ops
    assert ops.name == "triton"
    ha.FALLBACKS.clear()
    with torch.no_grad():
        got = model(tokens[None].cuda()).logits[0].float()
    assert ops.spec_fallbacks["linear"] == 0 and ops.spec_fallbacks["expert_ffn"] == 0, ops.fallback_shapes
    assert not ha.FALLBACKS, dict(ha.FALLBACKS)
    ours = load_model(dst, device="cuda")
    kern = ours.forward(tokens.cuda(), get_ops("triton")).float()
    weights = ours.forward(tokens.cuda(), get_ops("weights")).float()
    err = (got - kern).abs().max(-1).values
    scale = (kern - weights).abs().max(-1).values
    print(f"trained, cuda: transformers FP8-resident vs our kernels mode: median {err.median().item():.3g} max "
          f"{err.max().item():.3g}; kernels vs weights: median {scale.median().item():.3g}; argmax equal "
          f"{(got.argmax(-1) == kern.argmax(-1)).float().mean().item():.1%}")
    assert err.median() <= scale.median()
    assert (got.argmax(-1) == kern.argmax(-1)).float().mean() >= 0.9


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_trained_greedy_tokens_match_generate_kernels(trained):
    """issue 36, with FP8 numerics. Free-running greedy decoding amplifies the first near-tie that
    bf16 op-order noise flips (the trained fixture is byte-level: a flipped byte changes all that
    follows), so it is printed, not asserted: transformers' ``generate`` (FP8-resident, our
    attention) vs ``gptoss-fp8 generate --mode kernels``, beside our own ``--mode kernels`` vs
    ``--mode weights``. On CPU our ``w8a8`` and ``weights`` modes part after 34 of these 200 tokens;
    the first H200 run (eager attention) had transformers vs kernels at 130.

    Asserted, teacher-forced on ours' sequence (prompt + our kernels' greedy reply, 225 positions):
    transformers' argmax equals our kernels' at >= 99% of positions, and every disagreement is a
    near tie: the two tokens' logits are within NEAR_TIE of each other in both models. NEAR_TIE is
    measured here, not fixed: the 90th percentile over positions of max |kernels - weights| (our
    two modes on the same sequence: what activation quantization alone moves a position's logits).
    On CPU (w8a8 spec for kernels) that percentile is 0.25, and our w8a8 and weights modes
    themselves disagree at 3-5 of 225 positions (97.8-98.7%), each with margins <= 0.125."""
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.model.backends import get_ops
    from gptoss_fp8.model.load import load_model
    from gptoss_fp8.tokenizer import ByteTokenizer
    from gptoss_fp8.verify.generate import run

    dst = trained[0]
    n = 200
    prompt = ByteTokenizer().encode("import sys\n\n\ndef main():\n")
    quiet = lambda *a, **k: None  # noqa: E731
    kern = run(Checkpoint.open(dst), prompt, max_new_tokens=n, device="cuda", mode="kernels", echo=quiet).tokens
    weights = run(Checkpoint.open(dst), prompt, max_new_tokens=n, device="cuda", mode="weights", echo=quiet).tokens
    model = _hf(dst, device_map="cuda")
    assert model.config._attn_implementation == ha.NAME
    ha.CALLS.clear()
    ha.FALLBACKS.clear()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert not ha.FALLBACKS and ha.CALLS["prefill"] == 4, (dict(ha.CALLS), dict(ha.FALLBACKS))
    print(f"\ntrained, cuda, free-running greedy ({n} tokens): transformers vs our kernels equal for the first "
          f"{_first_divergence(theirs, kern)}; our kernels vs our weights: {_first_divergence(kern, weights)}")

    seq = torch.tensor(prompt + kern, device="cuda")
    ours = load_model(dst, device="cuda")
    with torch.no_grad():
        lh = model(seq[None]).logits[0].float()
        lk = ours.forward(seq, get_ops("triton")).float()
        lw = ours.forward(seq, get_ops("weights")).float()
    near_tie = (lk - lw).abs().max(-1).values.quantile(0.9).item()
    ah, ak, aw = lh.argmax(-1), lk.argmax(-1), lw.argmax(-1)
    agree = (ah == ak).float().mean().item()
    dis = (ah != ak).nonzero().flatten().tolist()
    margins = [(i, (lh[i, ah[i]] - lh[i, ak[i]]).item(), (lk[i, ak[i]] - lk[i, ah[i]]).item()) for i in dis]
    err = (lh - lk).abs().max(-1).values
    print(f"teacher-forced on our kernels' sequence ({len(seq)} positions): transformers vs kernels argmax equal "
          f"{agree:.2%} ({len(dis)} differ), max |logit diff| median {err.median().item():.3g} max "
          f"{err.max().item():.3g}; kernels vs weights argmax equal {(ak == aw).float().mean().item():.2%}; "
          f"NEAR_TIE (p90 of max |kernels - weights|) {near_tie:.3g}")
    for i, mh, mk in margins:
        print(f"  position {i}: transformers {ah[i].item()} (ahead by {mh:.3g}), kernels {ak[i].item()} "
              f"(ahead by {mk:.3g})")
    assert agree >= 0.99
    assert all(mh <= near_tie and mk <= near_tie for _, mh, mk in margins), margins


@pytest.fixture(scope="module")
def synthetic_20b(tmp_path_factory):
    """A synthetic gpt-oss-20b (random weights, real shapes; GPTOSS_FP8_HF_LAYERS layers, default 2)
    converted at tp 1 on the GPU."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    layers = int(os.environ.get("GPTOSS_FP8_HF_LAYERS", "2"))
    root = tmp_path_factory.mktemp("hf-20b")
    write_synthetic(root / "src", "20b", layers=layers, layout="hf")
    convert_checkpoint(root / "src", root / "fp8", device="cuda")
    return root / "fp8", layers


def _prefill_and_step(model, n: int) -> tuple[float, float]:
    """Seconds of a prefill of n tokens (use_cache) and of one decode step after it (second runs)."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        for _ in range(2):  # the first run compiles / autotunes
            out, t_prefill = _sync_time(lambda: model(ids, use_cache=True))
            nxt = out.logits[:, -1:].argmax(-1)
            _, t_step = _sync_time(lambda: model(nxt, past_key_values=out.past_key_values, use_cache=True))
    return t_prefill, t_step


def test_synthetic_20b_resident_memory_prefill_and_decode(synthetic_20b):
    """The FP8 model's parameters take the checkpoint's bytes on the GPU (the 20b: ~21 GB, not the
    ~39 GB of bf16); prefill 8192 and a decode step timed beside transformers' bf16 GptOss (the
    same weights dequantized, loaded on CPU then moved) in the same process."""
    dst, layers = synthetic_20b
    manifest = json.loads((dst / "layout.json").read_text())
    file_bytes = sum(f["bytes"] for f in manifest["ranks"][0]["files"].values())
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    fp8 = _hf(dst, device_map="cuda")
    resident = torch.cuda.memory_allocated() - base
    t8 = _prefill_and_step(fp8, 8192)
    del fp8
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    bf16 = _hf(dst).to("cuda")  # the CPU path: dequantized with our codec, then moved
    resident_bf16 = torch.cuda.memory_allocated() - base
    tb = _prefill_and_step(bf16, 8192)
    print(f"\nsynthetic 20b, {layers} layers, H200: resident FP8 {resident / 1e9:.2f} GB (files {file_bytes / 1e9:.2f} GB), "
          f"bf16 {resident_bf16 / 1e9:.2f} GB; prefill 8192: FP8 {t8[0] * 1e3:.1f} ms, bf16 {tb[0] * 1e3:.1f} ms; "
          f"decode step (context 8192, batch 1): FP8 {t8[1] * 1e3:.2f} ms, bf16 {tb[1] * 1e3:.2f} ms; "
          f"attention: {bf16.config._attn_implementation}")
    assert resident <= 1.05 * file_bytes
    assert resident < resident_bf16

"""``import gptoss_fp8.hf`` on a GPU: ``from_pretrained(DST, device_map="cuda")`` keeps the weights FP8
and runs them on our kernels (gptoss_fp8/hf.py, ``Fp8Linear`` / ``Fp8Experts`` on ``TritonOps``).

Every test here is marked ``gpu`` (skipped without CUDA). The CPU tests in test_hf.py and
test_hf_attention.py cover the same modules on the w8a8 spec and on the kernels through Triton's
interpreter. Attention runs on our kernels (gptoss_fp8/hf_attention.py, selected by the CUDA load).
Run on the H200:

    python -m pytest -q -s tests/test_hf_gpu.py                       # trained fixture + 2-layer 20b
    GPTOSS_FP8_HF_LAYERS=24 python -m pytest -q -s tests/test_hf_gpu.py -k synthetic   # the whole 20b

The synthetic case prints resident memory, prefill (8192 tokens) and one decode step for the FP8
model beside transformers' bf16 GptOss in the same process (eager attention and ours), and the
seconds of each stage (synth, convert, loads); compare with
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
    follows), so its length is printed, not asserted: transformers' ``generate`` (FP8-resident, our
    attention) vs ``gptoss-fp8 generate --mode kernels``, beside our own ``--mode kernels`` vs
    ``--mode weights``. On CPU our ``w8a8`` and ``weights`` modes part after 34 of these 200 tokens;
    the first H200 run (eager attention) had transformers vs kernels at 130.

    Asserted: where the free-running replies part, the two tokens are a near tie in both models (below).
    Teacher-forced on ours' sequence (prompt + our kernels' greedy reply, 225 positions):
    transformers' argmax equals our kernels' at >= 99% of positions, and every disagreement is a
    near tie: the two tokens' logits are within NEAR_TIE of each other in both models. A position's
    top-1 can differ between two models only where its lead is below their logit difference there;
    NEAR_TIE is the largest logit shift FP8 activation quantization alone causes at any position of
    this sequence (max over positions of max |kernels - weights|, our two modes, measured here), so
    a token that leads by more than that and still flips is not FP8 noise. CPU analogue (kernels
    through the interpreter, golden/trained, this prompt): that max 0.56-0.63 (p90 0.25, the median
    top-2 lead 3.4); our kernels vs weights disagree at 2 of 225 positions (99.1%); transformers
    FP8-resident vs our kernels at 2 (eager attention) and 3 (ours: 98.7%), leads <= 0.25."""
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
    calls, fallbacks = dict(ha.CALLS), dict(ha.FALLBACKS)
    print(f"\ntrained, cuda, free-running greedy ({n} tokens): transformers vs our kernels equal for the first "
          f"{_first_divergence(theirs, kern)}; our kernels vs our weights: {_first_divergence(kern, weights)}; "
          f"attention calls {calls}, to eager {fallbacks}")

    seq = torch.tensor(prompt + kern, device="cuda")
    ours = load_model(dst, device="cuda")
    with torch.no_grad():
        lh = model(seq[None]).logits[0].float()
        lk = ours.forward(seq, get_ops("triton")).float()
        lw = ours.forward(seq, get_ops("weights")).float()
    noise = (lk - lw).abs().max(-1).values
    near_tie = noise.max().item()
    ah, ak, aw = lh.argmax(-1), lk.argmax(-1), lw.argmax(-1)
    agree = (ah == ak).float().mean().item()
    dis = (ah != ak).nonzero().flatten().tolist()
    margins = [(i, (lh[i, ah[i]] - lh[i, ak[i]]).item(), (lk[i, ak[i]] - lk[i, ah[i]]).item()) for i in dis]
    err = (lh - lk).abs().max(-1).values
    print(f"teacher-forced on our kernels' sequence ({len(seq)} positions): transformers vs kernels argmax equal "
          f"{agree:.2%} ({len(dis)} differ), max |logit diff| median {err.median().item():.3g} max "
          f"{err.max().item():.3g}; kernels vs weights argmax equal {(ak == aw).float().mean().item():.2%}; "
          f"max |kernels - weights| per position: median {noise.median().item():.3g}, p90 "
          f"{noise.quantile(0.9).item():.3g}, max (NEAR_TIE) {near_tie:.3g}")
    for i, mh, mk in margins:
        print(f"  position {i}: transformers {ah[i].item()} (ahead by {mh:.3g}), kernels {ak[i].item()} "
              f"(ahead by {mk:.3g})")
    d = _first_divergence(theirs, kern)
    if d < min(len(theirs), len(kern)):  # the free-running divergence, read teacher-forced (same context up to it)
        pos = len(prompt) - 1 + d  # its logits choose reply token d
        a, b = kern[d], theirs[d]
        print(f"  free-running divergence at reply token {d}: ours {a}, transformers {b}; logit[{a}] - logit[{b}] on "
              f"this context: our kernels {(lk[pos, a] - lk[pos, b]).item():.3g}, transformers (prefill path) "
              f"{(lh[pos, a] - lh[pos, b]).item():.3g}; NEAR_TIE {near_tie:.3g}")
        # the free-running parting is a near tie too: on the shared context neither model leads the
        # other's token by more than FP8 noise (first H200 run: ours -0.125, transformers -0.0625, NEAR_TIE 0.656)
        assert abs((lk[pos, a] - lk[pos, b]).item()) <= near_tie, (d, a, b)
        assert abs((lh[pos, a] - lh[pos, b]).item()) <= near_tie, (d, a, b)
    assert not fallbacks and calls["prefill"] == 4, (calls, fallbacks)  # every attention call on a kernel
    assert all(mh <= near_tie and mk <= near_tie for _, mh, mk in margins), margins
    assert agree >= 0.99


def _replicated_source(root, layers: int, preset: str = "20b"):
    """A synthetic ``preset`` MXFP4 source of ``layers`` layers whose every layer holds layer 0's tensors:
    ``write_synthetic`` draws one layer (its random MXFP4 experts cost ~5 s a layer on one CPU
    core, the whole 20b ~2 minutes), the others are written under their own names from the same
    tensors. Real names, shapes, config.json and index; the timings and memory do not depend on
    the layers' values differing."""
    import shutil

    from safetensors.torch import load_file, save_file

    from gptoss_fp8.config import hf_config_dict, preset_config
    from gptoss_fp8.convert.synth import write_synthetic

    one = root / "one"
    write_synthetic(one, preset, layers=1, layout="hf")
    src = root / "src"
    src.mkdir()
    for f in one.iterdir():
        if not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, src / f.name)
    tensors = {}
    for f in sorted(one.glob("*.safetensors")):
        tensors.update(load_file(f))
    shutil.rmtree(one)
    layer0 = {k.removeprefix("model.layers.0."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    rest = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    weight_map = {}
    files = [("model-rest.safetensors", rest)] + [
        (f"model-layer{i:02d}.safetensors", {f"model.layers.{i}.{k}": v for k, v in layer0.items()}) for i in range(layers)]
    for name, ts in files:
        save_file(ts, str(src / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ts, name))
    total = sum(t.numel() * t.element_size() for _, ts in files for t in ts.values())
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (src / "config.json").write_text(json.dumps(hf_config_dict(preset_config(preset, layers)), indent=2) + "\n")
    return src


@pytest.fixture(scope="module")
def synthetic_20b(tmp_path_factory):
    """A synthetic gpt-oss-20b (random weights, real shapes; GPTOSS_FP8_HF_LAYERS layers, default 2:
    24 is the whole model) converted at tp 1 on the GPU: (converted, MXFP4 source, layers, seconds
    per stage). Up to 2 layers the source is ``write_synthetic``'s; beyond, ``_replicated_source``."""
    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.convert.synth import write_synthetic

    layers = int(os.environ.get("GPTOSS_FP8_HF_LAYERS", "2"))
    root = tmp_path_factory.mktemp("hf-20b")
    t0 = time.perf_counter()
    if layers <= 2:
        write_synthetic(root / "src", "20b", layers=layers, layout="hf")
        src = root / "src"
    else:
        src = _replicated_source(root, layers)
    t1 = time.perf_counter()
    convert_checkpoint(src, root / "fp8", device="cuda")
    t2 = time.perf_counter()
    return root / "fp8", src, layers, {"synth": t1 - t0, "convert (cuda)": t2 - t1}


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
    ~39 GB of bf16); prefill 8192 and a decode step timed beside transformers' bf16 GptOss in the
    same process: the MXFP4 source dequantized by transformers on the GPU (``Mxfp4Config(dequantize=True)``,
    ``device_map="cuda"``), with its eager attention and with ours. Every stage's seconds printed."""
    from transformers import Mxfp4Config

    dst, src, layers, stages = synthetic_20b
    manifest = json.loads((dst / "layout.json").read_text())
    file_bytes = sum(f["bytes"] for f in manifest["ranks"][0]["files"].values())
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    fp8, stages["load FP8 (cuda)"] = _sync_time(lambda: _hf(dst, device_map="cuda"))
    resident = torch.cuda.memory_allocated() - base
    assert fp8.config._attn_implementation == ha.NAME
    ha.FALLBACKS.clear()
    t8 = _prefill_and_step(fp8, 8192)
    assert not ha.FALLBACKS, dict(ha.FALLBACKS)
    del fp8
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    bf16, stages["load bf16 from MXFP4 (cuda)"] = _sync_time(
        lambda: _hf(src, device_map="cuda", quantization_config=Mxfp4Config(dequantize=True)))
    resident_bf16 = torch.cuda.memory_allocated() - base
    eager_attn = bf16.config._attn_implementation
    tb = _prefill_and_step(bf16, 8192)
    bf16.set_attn_implementation(ha.NAME)
    tbo = _prefill_and_step(bf16, 8192)
    print(f"\nsynthetic 20b, {layers} layers, H200: resident FP8 {resident / 1e9:.2f} GB (files {file_bytes / 1e9:.2f} GB), "
          f"bf16 {resident_bf16 / 1e9:.2f} GB\n"
          f"  prefill 8192: FP8 + our attention {t8[0] * 1e3:.1f} ms, bf16 + {eager_attn} {tb[0] * 1e3:.1f} ms, "
          f"bf16 + our attention {tbo[0] * 1e3:.1f} ms\n"
          f"  decode step (context 8192, batch 1): FP8 + our attention {t8[1] * 1e3:.2f} ms, bf16 + {eager_attn} "
          f"{tb[1] * 1e3:.2f} ms, bf16 + our attention {tbo[1] * 1e3:.2f} ms\n"
          f"  stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    assert resident <= 1.05 * file_bytes
    assert resident < resident_bf16

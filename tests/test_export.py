"""convert/export.write_hf_mxfp4 (how the trained fixture is made): float weights -> an HF-layout
MXFP4 source checkpoint that opens, converts and verifies like any other, experts rounded by
quant.mxfp4.encode_mxfp4 in the checkpoint's [E, out, in] orientation whichever way they came in."""

import json

import pytest
import torch
from safetensors.torch import load_file

from gptoss_fp8.checkpoint.format import hf_source_tensors
from gptoss_fp8.config import preset_config
from gptoss_fp8.convert.export import write_hf_mxfp4
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.mxfp4 import encode_mxfp4
from gptoss_fp8.tokenizer import BYT5_FILES, ByteTokenizer, byte_tokenizer_of

# hidden 192 != intermediate 160 and != 2 x 160: each expert weight's orientation is unambiguous
CFG = preset_config("tiny", layers=2, vocab_size=ByteTokenizer.vocab_size)


def _float_weights(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights as exported: layer 0's experts as transformers holds them, [E, in, out]; layer 1's as
    the checkpoint, [E, out, in]), (every expert weight in [E, out, in])."""
    g = torch.Generator().manual_seed(seed)
    tensors, experts = {}, {}
    for spec in hf_source_tensors(CFG):
        if spec.dtype == "uint8":
            base = spec.name.rsplit("_", 1)[0]
            if base in experts:
                continue
            e, out, k32 = spec.shape[:3]
            w = torch.randn(e, out, k32 * 32, generator=g) * 0.05
            experts[base] = w
            tensors[base] = w.transpose(1, 2).contiguous() if ".layers.0." in base else w
        else:
            tensors[spec.name] = torch.randn(spec.shape, generator=g) * 0.1
    return tensors, experts


def test_export_writes_a_source_that_opens_converts_and_verifies(tmp_path):
    from gptoss_fp8.checkpoint.checkpoint import Checkpoint
    from gptoss_fp8.checkpoint.source import SourceCheckpoint
    from gptoss_fp8.convert.convert import convert_checkpoint

    seed = int(torch.randint(0, 10**6, (1,)))
    tensors, experts = _float_weights(seed)
    src = tmp_path / "src"
    write_hf_mxfp4(src, CFG, tensors, config_extra={"eos_token_id": 1, "pad_token_id": 0},
                   files=BYT5_FILES | {"generation_config.json": {"eos_token_id": 1}})
    opened = SourceCheckpoint.open(src)
    assert opened.config == CFG
    assert set(opened.tensors) == {s.name for s in hf_source_tensors(CFG)}
    cfg_json = json.loads((src / "config.json").read_text())
    assert cfg_json["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg_json["eos_token_id"] == 1 and cfg_json["pad_token_id"] == 0
    assert json.loads((src / "generation_config.json").read_text()) == {"eos_token_id": 1}
    assert isinstance(byte_tokenizer_of(src), ByteTokenizer)
    st = load_file(str(src / "model.safetensors"))
    for base, w in experts.items():  # [E, out, in] whichever orientation was given
        blocks, scales = encode_mxfp4(w)
        assert torch.equal(st[base + "_blocks"], blocks) and torch.equal(st[base + "_scales"], scales), (seed, base)
    for name, t in tensors.items():
        if name not in experts:
            assert st[name].dtype == torch.bfloat16 and torch.equal(st[name], t.bfloat16()), name
    assert not list(src.glob("*.tmp"))
    # it converts, the tokenizer files come along, and the conversion verifies against OpenAI's model
    convert_checkpoint(src, tmp_path / "fp8")
    assert Checkpoint.open(tmp_path / "fp8").config == CFG
    assert isinstance(byte_tokenizer_of(tmp_path / "fp8"), ByteTokenizer)
    pytest.importorskip("gpt_oss.torch.model")
    from gptoss_fp8.verify.reference import reference_for
    from gptoss_fp8.verify.report import rounding_for
    from gptoss_fp8.verify.run import verify_checkpoint

    tokens = torch.tensor(ByteTokenizer().encode("def f(x):\n    return x * 2\n"))
    rounding, exact = rounding_for(tmp_path / "fp8")
    ref = reference_for(src, tokens, "cpu", None if exact else rounding)
    report, _ = verify_checkpoint(tmp_path / "fp8", ref, modes=["weights"])
    assert report["passed"], report["weights"]["failures"]
    assert report["weights"]["teacher_forced"]["limits_profile"] == "exact-cpu"


def test_export_names_a_missing_or_misshapen_tensor(tmp_path):
    tensors, _ = _float_weights(0)
    name = "model.layers.1.self_attn.sinks"
    with pytest.raises(GptOssFp8Error, match=f"tensor {name} is missing"):
        write_hf_mxfp4(tmp_path / "a", CFG, {k: v for k, v in tensors.items() if k != name})
    expert = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(GptOssFp8Error, match=f"tensor {expert} is missing"):
        write_hf_mxfp4(tmp_path / "b", CFG, {k: v for k, v in tensors.items() if k != expert})
    with pytest.raises(GptOssFp8Error, match=rf"tensor {name}: shape \[9\], expected \[8\]"):
        write_hf_mxfp4(tmp_path / "c", CFG, tensors | {name: torch.zeros(9)})
    with pytest.raises(GptOssFp8Error, match=rf"tensor {expert}: shape \[8, 192, 161\], expected \[8, 192, 160\]"):
        write_hf_mxfp4(tmp_path / "d", CFG, tensors | {expert: torch.zeros(8, 192, 161)})
    assert not any((tmp_path / x / "model.safetensors").exists() for x in "abcd")  # nothing half-written


def test_expert_orientation_is_explicit_where_the_shape_cannot_tell():
    """Where out == in (2I == H for gate_up_proj), "auto" refuses to guess; the explicit layouts
    transpose or not as told, and a shape that fits neither names the layout's expectation."""
    from dataclasses import replace

    from gptoss_fp8.convert.export import hf_expert_orientation

    cfg = replace(CFG, intermediate_size=CFG.hidden_size // 2)  # gate_up: [E, 192, 192] either way
    name = "model.layers.0.mlp.experts.gate_up_proj"
    w = torch.randn(cfg.num_local_experts, cfg.hidden_size, cfg.hidden_size)
    with pytest.raises(GptOssFp8Error, match=f"tensor {name}: .* reads the same in both orientations; pass expert_layout"):
        hf_expert_orientation(name, w, cfg)
    assert hf_expert_orientation(name, w, cfg, "checkpoint") is w
    assert torch.equal(hf_expert_orientation(name, w, cfg, "transformers"), w.transpose(1, 2))
    down = "model.layers.0.mlp.experts.down_proj"  # [E, H, I] = [8, 192, 96]: unambiguous
    d = torch.randn(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)
    assert hf_expert_orientation(down, d, cfg) is d
    assert torch.equal(hf_expert_orientation(down, d.transpose(1, 2), cfg), d)
    with pytest.raises(GptOssFp8Error, match=rf"tensor {down}: shape \[8, 192, 96\], expected \[8, 96, 192\]$"):
        hf_expert_orientation(down, d, cfg, "transformers")
    with pytest.raises(GptOssFp8Error, match="expert layout 'hf'"):
        hf_expert_orientation(down, d, cfg, "hf")

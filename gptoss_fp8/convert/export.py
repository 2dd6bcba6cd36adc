"""Write float gpt-oss weights as an HF-layout MXFP4 checkpoint (the layout the hub's releases use).

The trained fixture (``tools/train_fixture.py``) is made this way: a small gpt-oss trained in bf16,
its experts rounded to MXFP4 here (``quant.mxfp4.encode_mxfp4``: nearest e2m1 value under the
smallest power-of-two group scale that does not saturate), everything else kept in bf16, with a
byte-level tokenizer (``tokenizer.BYT5``). The result is a source checkpoint like any other: it
converts, verifies and runs with every command.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gptoss_fp8.checkpoint.format import hf_source_tensors
from gptoss_fp8.config import GptOssConfig, hf_config_dict
from gptoss_fp8.convert.writer import write_text_atomic
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.mxfp4 import encode_mxfp4

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


EXPERT_LAYOUTS = ("auto", "checkpoint", "transformers")


def hf_expert_orientation(name: str, w: torch.Tensor, cfg: GptOssConfig, layout: str = "auto") -> torch.Tensor:
    """An expert weight in the checkpoint's [E, out, in] orientation. ``layout`` says how ``w`` is
    held: "checkpoint" ([E, out, in]), "transformers" (its GptOss keeps gate_up_proj as [E, H, 2I]
    and down_proj as [E, I, H] in memory: [E, in, out]) or "auto" (told apart by shape, which
    fails where out == in: 2I == H for gate_up_proj, I == H for down_proj)."""
    if layout not in EXPERT_LAYOUTS:
        raise GptOssFp8Error(f"expert layout {layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    want = (e, 2 * i, h) if name.endswith("gate_up_proj") else (e, h, i)
    flipped = (want[0], want[2], want[1])
    shape = tuple(w.shape)
    if layout == "auto" and shape == want == flipped:
        raise GptOssFp8Error(f"tensor {name}: shape {list(shape)} reads the same in both orientations; "
                             "pass expert_layout='checkpoint' ([E, out, in]) or 'transformers' ([E, in, out])")
    if shape == want and layout in ("auto", "checkpoint"):
        return w
    if shape == flipped and layout in ("auto", "transformers"):
        return w.transpose(1, 2)
    expected = {"auto": f"{list(want)} (or its transpose)", "checkpoint": str(list(want)),
                "transformers": str(list(flipped))}[layout]
    raise GptOssFp8Error(f"tensor {name}: shape {list(shape)}, expected {expected}")


def write_hf_mxfp4(dst: Path, cfg: GptOssConfig, tensors: dict[str, torch.Tensor], *,
                   config_extra: dict | None = None, files: dict[str, dict] | None = None,
                   expert_layout: str = "auto") -> None:
    """Write ``tensors`` (HF names; expert weights as ``...experts.gate_up_proj`` / ``down_proj``
    floats held as ``expert_layout`` says, see ``hf_expert_orientation``) to ``dst`` as an MXFP4
    source checkpoint: ``model.safetensors``, ``config.json`` (``hf_config_dict`` updated with
    ``config_extra``) and the extra JSON ``files``."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for spec in hf_source_tensors(cfg):
        base, _, part = spec.name.rpartition("_")
        if spec.dtype == "uint8":
            src = base if base.endswith(EXPERT_WEIGHTS) else spec.name
            if src not in tensors:
                raise GptOssFp8Error(f"tensor {src} is missing from the weights to export")
            if src + "_blocks" not in out:
                blocks, scales = encode_mxfp4(hf_expert_orientation(src, tensors[src].float(), cfg,
                                                                   expert_layout).contiguous())
                out[src + "_blocks"], out[src + "_scales"] = blocks, scales
            continue
        if spec.name not in tensors:
            raise GptOssFp8Error(f"tensor {spec.name} is missing from the weights to export")
        t = tensors[spec.name]
        if tuple(t.shape) != tuple(spec.shape):
            raise GptOssFp8Error(f"tensor {spec.name}: shape {list(t.shape)}, expected {list(spec.shape)}")
        out[spec.name] = t.to(torch.bfloat16).contiguous()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / "model.safetensors.tmp"
    save_file(out, str(tmp), metadata={"format": "pt", "producer": "gptoss-fp8 export"})
    tmp.chmod(0o644)
    tmp.replace(dst / "model.safetensors")
    for name, content in (files or {}).items():
        write_text_atomic(dst / name, json.dumps(content, indent=2) + "\n", "export again")
    write_text_atomic(dst / "config.json", json.dumps(hf_config_dict(cfg) | (config_extra or {}), indent=2) + "\n",
                      "export again")

"""Checkpoint layouts: which tensors a gpt-oss checkpoint holds and what the converter does to each.

One table (``RULES``) maps every source tensor name pattern to its transform; no other code
decides how a tensor is converted. Names are Hugging Face names throughout (design.md, section 2).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from gptoss_fp8.config import GptOssConfig

# The files of a checkpoint directory (HF names for what HF defines).
INDEX_NAME = "model.safetensors.index.json"
REPORT_NAME = "conversion.json"  # the conversion record (what was converted, how, exactness)
LAYOUT_NAME = "layout.json"  # the shard-plan manifest of a converted checkpoint
LAYOUT_FORMAT = "gptoss-fp8-layout/1"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class Kind(str, enum.Enum):
    copy = "copy"  # written unchanged (bf16 / float tensors)
    linear_fp8 = "linear_fp8"  # bf16 [N, K] weight -> fp8 weight + weight_scale_inv
    experts_mxfp4 = "experts_mxfp4"  # *_blocks + *_scales (MXFP4) -> fp8 [E, N, K] + *_scale_inv


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    kind: Kind


_L = r"model\.layers\.(\d+)\."
RULES: tuple[Rule, ...] = (
    Rule(re.compile(_L + r"self_attn\.[qkvo]_proj\.weight"), Kind.linear_fp8),
    Rule(re.compile(_L + r"mlp\.experts\.(gate_up|down)_proj_blocks"), Kind.experts_mxfp4),
    Rule(re.compile(r".*"), Kind.copy),
)

# Modules left in bf16 by the FP8 checkpoint (quantization_config.modules_to_not_convert).
NOT_CONVERTED = ["model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
ATTENTION_MODULES = "model.layers.*.self_attn"


def rule_for(name: str) -> Rule:
    for r in RULES:
        if r.pattern.fullmatch(name):
            return r
    raise AssertionError(name)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float" (any float dtype, bf16 in the real checkpoints) or "uint8"


def hf_source_tensors(cfg: GptOssConfig) -> list[TensorSpec]:
    """Every tensor of an HF-layout gpt-oss MXFP4 checkpoint, with its shape, in file order."""
    h, i, e, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.vocab_size
    out: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (v, h), "float")]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [
            TensorSpec(p + "input_layernorm.weight", (h,), "float"),
            TensorSpec(p + "self_attn.q_proj.weight", (cfg.q_dim, h), "float"),
            TensorSpec(p + "self_attn.q_proj.bias", (cfg.q_dim,), "float"),
            TensorSpec(p + "self_attn.k_proj.weight", (cfg.kv_dim, h), "float"),
            TensorSpec(p + "self_attn.k_proj.bias", (cfg.kv_dim,), "float"),
            TensorSpec(p + "self_attn.v_proj.weight", (cfg.kv_dim, h), "float"),
            TensorSpec(p + "self_attn.v_proj.bias", (cfg.kv_dim,), "float"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, cfg.q_dim), "float"),
            TensorSpec(p + "self_attn.o_proj.bias", (h,), "float"),
            TensorSpec(p + "self_attn.sinks", (cfg.num_attention_heads,), "float"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "float"),
            TensorSpec(p + "mlp.router.weight", (e, h), "float"),
            TensorSpec(p + "mlp.router.bias", (e,), "float"),
            TensorSpec(p + "mlp.experts.gate_up_proj_blocks", (e, 2 * i, h // 32, 16), "uint8"),
            TensorSpec(p + "mlp.experts.gate_up_proj_scales", (e, 2 * i, h // 32), "uint8"),
            TensorSpec(p + "mlp.experts.gate_up_proj_bias", (e, 2 * i), "float"),
            TensorSpec(p + "mlp.experts.down_proj_blocks", (e, h, i // 32, 16), "uint8"),
            TensorSpec(p + "mlp.experts.down_proj_scales", (e, h, i // 32), "uint8"),
            TensorSpec(p + "mlp.experts.down_proj_bias", (e, h), "float"),
        ]
    out += [TensorSpec("model.norm.weight", (h,), "float"), TensorSpec("lm_head.weight", (v, h), "float")]
    return out


def scales_name(blocks_name: str) -> str:
    assert blocks_name.endswith("_blocks"), blocks_name
    return blocks_name[: -len("_blocks")] + "_scales"


def fp8_names(source_name: str, kind: Kind) -> tuple[str, str]:
    """(weight name, scale_inv name) of the FP8 output for a converted source tensor."""
    if kind is Kind.experts_mxfp4:
        base = source_name[: -len("_blocks")]  # ...experts.gate_up_proj
        return base, base + "_scale_inv"
    assert kind is Kind.linear_fp8, kind
    return source_name, source_name + "_scale_inv"


def assign_shards(sizes: list[int], max_bytes: int) -> list[int]:
    """Greedy assignment of consecutive tensors to shard files of at most max_bytes (>= 1 tensor each)."""
    out, cur, acc = [], 0, 0
    for s in sizes:
        if acc and acc + s > max_bytes:
            cur, acc = cur + 1, 0
        out.append(cur)
        acc += s
    return out


def shard_file_names(n: int) -> list[str]:
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def attention_is_fp8(raw_config: dict) -> bool:
    """Whether the checkpoint's attention projections are FP8 (recorded in quantization_config)."""
    q = raw_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return False
    return ATTENTION_MODULES not in q.get("modules_to_not_convert", [])

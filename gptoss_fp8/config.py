"""gpt-oss model configuration, mirroring the Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gptoss_fp8.errors import GptOssFp8Error

# config.json keys every gpt-oss checkpoint must have (num_experts_per_tok may also be spelled
# experts_per_token, as OpenAI's own files do).
_REQUIRED = (
    "num_hidden_layers",
    "num_local_experts",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class GptOssConfig:
    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 150000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False,
    })
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    initial_context_length: int = 4096

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
            ))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "GptOssConfig":
        """Validate a config.json dict; unknown keys are ignored (kept by whoever copies the file)."""
        if d.get("model_type") != "gpt_oss":
            raise GptOssFp8Error(
                f"{where}: model_type is {d.get('model_type')!r}, not 'gpt_oss'; this tool converts gpt-oss checkpoints only"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if "num_experts_per_tok" not in d and "experts_per_token" not in d:
            missing.append("num_experts_per_tok")
        if missing:
            raise GptOssFp8Error(f"{where}: missing key(s) {', '.join(missing)}; is this a complete gpt-oss config?")
        kw: dict[str, Any] = {}
        names = {f.name for f in fields(cls)}
        for k in names:
            if k in d:
                kw[k] = d[k]
        kw.setdefault("num_experts_per_tok", d.get("experts_per_token"))
        if "layer_types" in kw:
            kw["layer_types"] = tuple(kw["layer_types"])
        ints = [f.name for f in fields(cls) if f.type == "int"]
        for k in ints:
            if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool) or kw[k] <= 0):
                raise GptOssFp8Error(f"{where}: {k} must be a positive integer, got {kw[k]!r}")
        cfg = cls(**kw)
        cfg.validate(where)
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "GptOssConfig":
        return cls.from_dict(read_config_json(path), str(path))

    def validate(self, where: str = "config") -> None:
        def bad(msg: str) -> GptOssFp8Error:
            return GptOssFp8Error(f"{where}: {msg}")

        if self.hidden_size % 32 or self.intermediate_size % 32:
            raise bad(
                f"hidden_size {self.hidden_size} and intermediate_size {self.intermediate_size} must be multiples "
                "of 32 (the MXFP4 group size)"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise bad(f"num_experts_per_tok {self.num_experts_per_tok} > num_local_experts {self.num_local_experts}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise bad(f"unknown layer_types {sorted(unknown)}")

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["experts_per_token"] = self.num_experts_per_tok
        d["model_type"] = "gpt_oss"
        return d


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a config.json with one-line errors for missing or malformed files."""
    if not path.is_file():
        raise GptOssFp8Error(f"{path}: config.json not found; point at a gpt-oss checkpoint directory")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GptOssFp8Error(f"{path}: invalid JSON ({e}); re-download or fix the file") from None
    if not isinstance(d, dict):
        raise GptOssFp8Error(f"{path}: expected a JSON object at the top level")
    return d


# ----------------------------------------------------------------------------------------------
# Presets: the released models' shapes, and a tiny one for tests and the no-network demo.

PRESETS: dict[str, dict] = {
    # Small but not aligned anywhere: hidden 1.5 blocks, intermediate 1.25 blocks, odd vocab.
    # 8 q heads and 8 experts so every tp/ep layout up to 8 has work on every rank.
    "tiny": dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, hidden_size=192,
                 intermediate_size=160, head_dim=16, num_attention_heads=8, num_key_value_heads=2,
                 vocab_size=503, sliding_window=8),
    "20b": dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, hidden_size=2880,
                intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                vocab_size=201088, sliding_window=128),
    "120b": dict(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4, hidden_size=2880,
                 intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                 vocab_size=201088, sliding_window=128),
}


def preset_config(preset: str, layers: int | None = None, **overrides) -> GptOssConfig:
    if preset not in PRESETS:
        raise GptOssFp8Error(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    if layers is not None:
        if not 1 <= layers:
            raise GptOssFp8Error(f"--layers must be >= 1, got {layers}")
        kw["num_hidden_layers"] = layers
    kw.update(overrides)
    kw.pop("layer_types", None)
    cfg = GptOssConfig(**kw)
    cfg.validate(f"preset {preset}")
    return cfg


# The released checkpoints' special tokens (o200k_harmony): <|startoftext|>, <|return|>,
# <|endoftext|>, <|call|>.
_RELEASED_SPECIAL = {"bos": 199998, "eos": 200002, "pad": 199999, "call": 200012}


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """bos / eos / pad / call token ids for a vocabulary: the released ids where they fit, else the
    last four ids of the vocabulary (transformers refuses a pad id outside it)."""
    if vocab_size > max(_RELEASED_SPECIAL.values()):
        return dict(_RELEASED_SPECIAL)
    assert vocab_size >= 4, f"vocab_size {vocab_size} leaves no room for the special tokens"
    return {k: vocab_size - 1 - i for i, k in enumerate(_RELEASED_SPECIAL)}


def hf_config_dict(cfg: GptOssConfig) -> dict:
    """An HF ``config.json`` for cfg, with the keys the released checkpoints carry."""
    d = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": special_token_ids(cfg.vocab_size)["eos"],
        "experts_per_token": cfg.num_experts_per_tok,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initial_context_length": cfg.initial_context_length,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "layer_types": list(cfg.layer_types),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": cfg.num_attention_heads,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_local_experts": cfg.num_local_experts,
        "output_router_logits": False,
        "pad_token_id": special_token_ids(cfg.vocab_size)["pad"],
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": dict(cfg.rope_scaling),
        "rope_theta": cfg.rope_theta,
        "router_aux_loss_coef": 0.9,
        "sliding_window": cfg.sliding_window,
        "swiglu_limit": cfg.swiglu_limit,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }
    return d


def original_config_dict(cfg: GptOssConfig) -> dict:
    """OpenAI's ``original/config.json`` (exactly gpt_oss.torch's ModelConfig fields)."""
    rs = cfg.rope_scaling
    return {
        "num_hidden_layers": cfg.num_hidden_layers, "num_experts": cfg.num_local_experts,
        "experts_per_token": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "swiglu_limit": cfg.swiglu_limit, "head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "sliding_window": cfg.sliding_window,
        "initial_context_length": int(rs.get("original_max_position_embeddings", cfg.initial_context_length)),
        "rope_theta": cfg.rope_theta, "rope_scaling_factor": float(rs.get("factor", 32.0)),
        "rope_ntk_alpha": float(rs.get("beta_slow", 1.0)), "rope_ntk_beta": float(rs.get("beta_fast", 32.0)),
    }

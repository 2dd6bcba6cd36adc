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

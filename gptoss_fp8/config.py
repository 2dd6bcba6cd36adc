"""gpt-oss model configuration, mirroring the Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
import stat
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

# Generous upper bounds, checked before anything is sized by them (the released 120b is 36 layers,
# 128 experts, hidden 2880, vocab 201088): a corrupt or hostile config.json must fail at once, not
# allocate per layer or per expert first.
LIMITS = {
    "num_hidden_layers": 1024,
    "num_local_experts": 4096,
    "num_experts_per_tok": 4096,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 18,
    "head_dim": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "vocab_size": 1 << 23,
    "sliding_window": 1 << 24,
    "initial_context_length": 1 << 24,
}
_FLOATS = ("rope_theta", "rms_norm_eps", "swiglu_limit")
MAX_JSON_DEPTH = 64


def json_depth_exceeds(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether obj nests lists/dicts deeper than limit (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        elif not isinstance(o, list):
            continue
        if d > limit:
            return True
        stack.extend((x, d + 1) for x in o if isinstance(x, (dict, list)))
    return False


def load_json(raw: str | bytes, where: str, what: str = "JSON", object_pairs_hook=None) -> Any:
    """json.loads with one-line errors: invalid JSON, and nesting deeper than MAX_JSON_DEPTH."""
    try:
        obj = json.loads(raw, object_pairs_hook=object_pairs_hook)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GptOssFp8Error(f"{where}: invalid {what} ({e}); re-download or fix the file") from None
    except RecursionError:
        obj = None
        deep = True
    else:
        deep = json_depth_exceeds(obj)
    if deep:
        raise GptOssFp8Error(f"{where}: {what} nested more than {MAX_JSON_DEPTH} levels deep; the file is corrupt, "
                             "re-download or fix it")
    return obj


def _check_bounds(kw: dict[str, Any], where: str) -> None:
    """Types and sane bounds of the sizing fields, before any of them sizes an allocation."""
    for k, cap in LIMITS.items():
        v = kw.get(k)
        if v is None and k not in kw:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise GptOssFp8Error(f"{where}: {k} must be a positive integer, got {v!r}")
        if v > cap:
            raise GptOssFp8Error(f"{where}: {k} is {v}, above the limit {cap} of any plausible gpt-oss model; fix config.json")
    for k in _FLOATS:
        if k in kw:
            v = kw[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise GptOssFp8Error(f"{where}: {k} must be a positive finite number, got {v!r}")
    if "tie_word_embeddings" in kw and not isinstance(kw["tie_word_embeddings"], bool):
        raise GptOssFp8Error(f"{where}: tie_word_embeddings must be true or false, got {kw['tie_word_embeddings']!r}")
    if "rope_scaling" in kw and not isinstance(kw["rope_scaling"], dict):
        raise GptOssFp8Error(f"{where}: rope_scaling must be an object, got {kw['rope_scaling']!r}")
    lt = kw.get("layer_types", ())
    if not isinstance(lt, (list, tuple)) or not all(isinstance(x, str) for x in lt):
        shown = repr(lt) if len(repr(lt)) < 60 else repr(lt)[:57] + "..."
        raise GptOssFp8Error(f"{where}: layer_types must be a list of strings (one per layer), got {shown}")
    if lt and len(lt) != kw.get("num_hidden_layers"):
        raise GptOssFp8Error(f"{where}: layer_types has {len(lt)} entries for {kw.get('num_hidden_layers')} layers")


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
        _check_bounds({f.name: getattr(self, f.name) for f in fields(self)}, "config")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
            ))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> GptOssConfig:
        """Validate a config.json dict; unknown keys are ignored (kept by whoever copies the file)."""
        if "num_experts" in d and "model_type" not in d:  # (checkpoint.check_converted says it for a converted one)
            raise GptOssFp8Error(f"{where}: OpenAI's original/ layout, which this tool does not read; give the Hugging "
                                 "Face layout (the hub repo's root, the directory above original/)")
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
        ints = [f.name for f in fields(cls) if f.type == "int"]
        for k in ints:
            if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool) or kw[k] <= 0):
                raise GptOssFp8Error(f"{where}: {k} must be a positive integer, got {kw[k]!r}")
        _check_bounds(kw, where)  # before the dataclass sizes anything by these values
        if "layer_types" in kw:
            kw["layer_types"] = tuple(kw["layer_types"])
        cfg = cls(**kw)
        cfg.validate(where)
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> GptOssConfig:
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


MAX_CONFIG_BYTES = 16 * 1024**2


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a config.json with one-line errors for missing or malformed files."""
    try:
        st = path.stat()
    except OSError:
        raise GptOssFp8Error(f"{path}: config.json not found; point at a gpt-oss checkpoint directory") from None
    if stat.S_ISDIR(st.st_mode):
        raise GptOssFp8Error(f"{path}: is a directory, not a config.json file; point at a gpt-oss checkpoint directory")
    if not stat.S_ISREG(st.st_mode):
        raise GptOssFp8Error(f"{path}: not a regular file; config.json must be a plain file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise GptOssFp8Error(f"{path}: {st.st_size} bytes, too large for a config.json; fix the file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GptOssFp8Error(f"{path}: cannot read ({e.strerror})") from None
    d = load_json(raw, str(path))
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
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= LIMITS["num_hidden_layers"]:
            raise GptOssFp8Error(f"--layers must be an integer from 1 to {LIMITS['num_hidden_layers']}, got {layers!r}")
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

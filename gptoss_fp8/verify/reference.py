"""OpenAI's reference (``gpt_oss.torch``) on the SOURCE MXFP4 checkpoint, or a saved logits file.

The reference is OpenAI's code, unchanged: ``Transformer.from_checkpoint`` for an ``original/``
folder; for a Hugging Face layout its ``Transformer`` is built from the same config and its
parameters are filled from the HF tensors renamed in memory (qkv = cat(q, k, v), MXFP4 experts
decoded exactly as its ``Checkpoint`` does). Forward hooks on its blocks capture the residual
stream after each attention and each MLP, so a divergence can be located to a layer and a part.

Saved reference file (safetensors): ``logits`` float32 [T, V], ``tokens`` int64 [T], and
``hidden.{layer}.{attn|mlp}`` bf16 [T, H], ``hidden.{layer}.router`` bf16 [T, E] (router logits);
metadata ``producer``, ``source``, ``device`` (the device type OpenAI's model ran on; files without
it were made on CPU, as every golden file is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptoss_fp8.errors import GptOssFp8Error

REF_INSTALL = "pip install --no-deps --ignore-requires-python gpt-oss==0.0.9"
# Per-token expert weights the reference gathers ([tokens, k, 2I, H] bf16): bound them by running
# its MLP blocks on token chunks (per-token math, so the result is the same).
MLP_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Rounding:
    """The weight rounding a conversion applies: FP8 128x128 blocks with ``scale_mode`` scales for the
    experts, and for the attention projections too when ``attention_fp8``."""

    scale_mode: str = "pow2"
    attention_fp8: bool = True

    def key(self) -> str:
        return f"{self.scale_mode}/attention-{'fp8' if self.attention_fp8 else 'bf16'}"

    @classmethod
    def from_key(cls, key: str) -> Rounding:
        mode, attn = key.split("/attention-")
        return cls(mode, attn == "fp8")


@dataclass
class Reference:
    """Reference logits (float32 [T, V]) and captures ("{i}.attn"/"{i}.mlp" bf16 [T, H], "{i}.router"
    bf16 [T, E]) of OpenAI's model on the source. ``expected``: the same model with the
    conversion's weight rounding applied (``rounding``): what a correct checkpoint's ``weights``
    mode reproduces to bf16 noise (bit for bit on CPU)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = ""
    expected: Reference | None = None
    rounding: Rounding | None = None
    device: str = "cpu"  # device type OpenAI's model ran on ("cpu" / "cuda")


def _gpt_oss():
    try:
        from gpt_oss.torch import model as ref_model
        from gpt_oss.torch.weights import Checkpoint  # noqa: F401
    except ImportError:
        raise GptOssFp8Error(f"OpenAI's reference package gpt_oss is not installed; run: {REF_INSTALL}") from None
    return ref_model


def _hf_to_reference_names(n_layers: int) -> dict[str, tuple[str, ...]]:
    """reference parameter -> HF tensor name(s) (one table; experts are (blocks, scales) pairs)."""
    m = {"embedding.weight": ("model.embed_tokens.weight",), "unembedding.weight": ("lm_head.weight",),
         "norm.scale": ("model.norm.weight",)}
    for n in range(n_layers):
        p, q = f"model.layers.{n}.", f"block.{n}."
        m |= {
            q + "attn.norm.scale": (p + "input_layernorm.weight",),
            q + "attn.qkv.weight": tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
            q + "attn.qkv.bias": tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"),
            q + "attn.sinks": (p + "self_attn.sinks",),
            q + "attn.out.weight": (p + "self_attn.o_proj.weight",),
            q + "attn.out.bias": (p + "self_attn.o_proj.bias",),
            q + "mlp.norm.scale": (p + "post_attention_layernorm.weight",),
            q + "mlp.gate.weight": (p + "mlp.router.weight",),
            q + "mlp.gate.bias": (p + "mlp.router.bias",),
            q + "mlp.mlp1_weight": (p + "mlp.experts.gate_up_proj_blocks", p + "mlp.experts.gate_up_proj_scales"),
            q + "mlp.mlp1_bias": (p + "mlp.experts.gate_up_proj_bias",),
            q + "mlp.mlp2_weight": (p + "mlp.experts.down_proj_blocks", p + "mlp.experts.down_proj_scales"),
            q + "mlp.mlp2_bias": (p + "mlp.experts.down_proj_bias",),
        }
    return m


def _config_or_none(path: Path) -> dict | None:
    """A directory's config.json as a dict, or None when absent or not JSON (probing only)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_hf_mxfp4(path: Path) -> bool:
    d = _config_or_none(path)
    return (d is not None and d.get("model_type") == "gpt_oss"
            and (d.get("quantization_config") or {}).get("quant_method") == "mxfp4")


def is_original(path: Path) -> bool:
    d = _config_or_none(path)
    return d is not None and "num_experts" in d and "model_type" not in d


def load_reference_model(src: Path, device: str = "cpu"):
    """OpenAI's ``Transformer`` on a source checkpoint: an HF-layout MXFP4 directory (renamed in
    memory), an ``original/`` folder, or a directory holding one."""
    src = Path(src)
    ref_model = _gpt_oss()
    if is_hf_mxfp4(src):
        return _from_hf(src, device, ref_model)
    for p in (src, src / "original"):
        if is_original(p):
            return ref_model.Transformer.from_checkpoint(str(p), device=device)
    raise GptOssFp8Error(
        f"{src}: not a gpt-oss MXFP4 source (no HF config.json with quant_method mxfp4, no original/config.json) "
        "nor a .safetensors reference file; point --reference at the checkpoint you converted from"
    )


def _from_hf(src: Path, device: str, ref_model):
    from gptoss_fp8.checkpoint.checkpoint import read_tensors
    from gptoss_fp8.config import GptOssConfig, original_config_dict
    from gptoss_fp8.quant.mxfp4 import decode_mxfp4

    cfg = GptOssConfig.from_file(src / "config.json")
    if cfg.layer_types != tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)):
        raise GptOssFp8Error(f"{src}/config.json: layer_types are not the alternating pattern OpenAI's reference implements")
    config = ref_model.ModelConfig(**original_config_dict(cfg))
    model = ref_model.Transformer(config=config, device=torch.device(device))
    model.eval()
    names = _hf_to_reference_names(cfg.num_hidden_layers)
    for pname, param in model.named_parameters():
        hf = names[pname]
        ts = read_tensors(src, list(hf))
        missing = [n for n in hf if n not in ts]
        if missing:
            raise GptOssFp8Error(f"{src}: tensor {missing[0]} is missing; is this a complete gpt-oss checkpoint?")
        if pname.endswith(("mlp1_weight", "mlp2_weight")):
            blocks, scales = ts[hf[0]], ts[hf[1]]
            shape = (*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)
            if shape != tuple(param.shape):
                raise GptOssFp8Error(f"{src}: tensor {hf[0]} decodes to {list(shape)}, the reference expects {list(param.shape)}")
            with torch.no_grad():
                for e in range(blocks.shape[0]):  # one expert at a time: decoding holds int64 codes
                    param[e].copy_(decode_mxfp4(blocks[e], scales[e], torch.bfloat16))
            del ts, blocks, scales
            continue
        t = torch.cat([ts[n] for n in hf]) if len(hf) > 1 else ts[hf[0]]
        if t.shape != param.shape:
            raise GptOssFp8Error(f"{src}: tensor {hf[0]} has shape {list(t.shape)}, the reference expects {list(param.shape)}")
        with torch.no_grad():
            param.copy_(t)
        del ts, t
    return model


def _round_weight(w: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """w -> dequantize(quantize(w)) in bf16: exactly what a correct FP8 checkpoint holds (quant/fp8.py)."""
    from gptoss_fp8.quant.fp8 import dequantize_weight_blocks, quantize_weight_blocks

    q, s = quantize_weight_blocks(w.float(), scale_mode)
    return dequantize_weight_blocks(q, s, torch.bfloat16)


@torch.no_grad()
def apply_rounding(model, rounding: Rounding) -> None:
    """Replace, in OpenAI's model, every weight the conversion turns into FP8 by its FP8 round trip:
    experts (per expert, [2I, H] and [H, I]) and, with FP8 attention, q, k, v (each its own block
    grid, as converted) and o_proj."""
    for block in model.block:
        if rounding.attention_fp8:
            a = block.attn
            q_dim = a.num_attention_heads * a.head_dim
            kv_dim = a.num_key_value_heads * a.head_dim
            parts = torch.split(a.qkv.weight, [q_dim, kv_dim, kv_dim])
            a.qkv.weight.copy_(torch.cat([_round_weight(p, rounding.scale_mode) for p in parts]))
            a.out.weight.copy_(_round_weight(a.out.weight, rounding.scale_mode))
        for w in (block.mlp.mlp1_weight, block.mlp.mlp2_weight):
            for e in range(w.shape[0]):
                w[e].copy_(_round_weight(w[e], rounding.scale_mode))


def _chunk_mlp(block_mlp, per_token_bytes: int) -> None:
    """Run one reference MLPBlock on token chunks (its math is per token; bounds its gathers)."""
    orig = block_mlp.forward
    chunk = max(1, MLP_CHUNK_BYTES // max(per_token_bytes, 1))

    def forward(x):
        if x.shape[0] <= chunk:
            return orig(x)
        return torch.cat([orig(x[a:a + chunk]) for a in range(0, x.shape[0], chunk)])

    block_mlp.forward = forward


def _append(d: dict, key: str, t: torch.Tensor) -> None:
    """Router logits arrive per token chunk (see _chunk_mlp): concatenate them."""
    d[key] = torch.cat([d[key], t]) if key in d else t


@torch.inference_mode()
def run_reference_model(model, tokens: torch.Tensor, source: str = "") -> Reference:
    """Logits (float32) and per-block residual captures from OpenAI's Transformer."""
    hidden: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.block):
        mlp = block.mlp
        per_token = mlp.experts_per_token * mlp.mlp1_weight.shape[1] * mlp.mlp1_weight.shape[2] * 2
        _chunk_mlp(mlp, per_token)
        hooks.append(block.attn.register_forward_hook(lambda m, a, out, i=i: hidden.__setitem__(f"{i}.attn", out)))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, out, i=i: hidden.__setitem__(f"{i}.mlp", out)))
        hooks.append(block.mlp.gate.register_forward_hook(lambda m, a, out, i=i: _append(hidden, f"{i}.router", out)))
    try:
        dev = next(model.parameters()).device
        logits = model(tokens.to(device=dev, dtype=torch.int32)).float().cpu()
    finally:
        for h in hooks:
            h.remove()
        for block in model.block:  # drop the chunking wrappers (they would keep the model in a cycle)
            block.mlp.__dict__.pop("forward", None)
    return Reference(tokens.cpu().long(), logits, {k: v.cpu() for k, v in hidden.items()}, source, device=dev.type)


def save_reference(ref: Reference, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"logits": ref.logits.float().contiguous(), "tokens": ref.tokens.long().contiguous()}
    tensors |= {f"hidden.{k}": v.contiguous() for k, v in ref.hidden.items()}
    meta = {"producer": "gptoss-fp8 reference (gpt_oss.torch 0.0.9)", "source": ref.source, "device": ref.device}
    if ref.expected is not None and ref.rounding is not None:
        tensors["expected.logits"] = ref.expected.logits.float().contiguous()
        tensors |= {f"expected.hidden.{k}": v.contiguous() for k, v in ref.expected.hidden.items()}
        meta["expected_rounding"] = ref.rounding.key()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def load_reference_file(path: Path) -> Reference:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if "logits" not in keys:
                raise GptOssFp8Error(f"{path}: no tensor 'logits' (float32 [tokens, vocab]); not a reference logits file")
            logits = f.get_tensor("logits").float()
            tokens = f.get_tensor("tokens").long() if "tokens" in keys else None
            hidden = {k[len("hidden."):]: f.get_tensor(k) for k in keys if k.startswith("hidden.")}
            meta = f.metadata() or {}
            source = meta.get("source", str(path))
            expected = rounding = None
            if "expected.logits" in keys and "expected_rounding" in meta:
                rounding = Rounding.from_key(meta["expected_rounding"])
                expected = Reference(torch.empty(0, dtype=torch.long), f.get_tensor("expected.logits").float(),
                                     {k[len("expected.hidden."):]: f.get_tensor(k)
                                      for k in keys if k.startswith("expected.hidden.")},
                                     f"{source} with {rounding.key()} weight rounding")
    except GptOssFp8Error:
        raise
    except Exception as e:
        raise GptOssFp8Error(f"{path}: cannot read as safetensors ({e}); "
                             "pass a reference logits file or a checkpoint directory") from None
    if logits.dim() != 2:
        raise GptOssFp8Error(f"{path}: logits have shape {list(logits.shape)}, expected [tokens, vocab]")
    if tokens is None:
        tokens = torch.empty(0, dtype=torch.long)
    if expected is not None:
        expected.tokens = tokens
    return Reference(tokens, logits, hidden, source, expected, rounding, device=meta.get("device", "cpu"))


def reference_for(reference: Path, tokens: torch.Tensor | None, device: str = "cpu",
                  rounding: Rounding | None = None) -> Reference:
    """A saved reference file (its tokens must match when tokens are given) or a run of OpenAI's model
    on the source; with ``rounding``, also a second run with the conversion's weight rounding applied
    (``Reference.expected``). A file's expected logits are kept only if made with the same rounding."""
    reference = Path(reference)
    if reference.is_file():
        ref = load_reference_file(reference)
        if tokens is not None and ref.tokens.numel() and not torch.equal(ref.tokens, tokens.long()):
            raise GptOssFp8Error(
                f"{reference}: holds logits for {ref.tokens.numel()} other tokens than the ones given; "
                "pass the same --tokens, or none to use the file's"
            )
        if tokens is None and not ref.tokens.numel():
            raise GptOssFp8Error(f"{reference}: holds no 'tokens'; pass --tokens with the ids its logits were computed on")
        if tokens is not None and ref.logits.shape[0] != tokens.numel():
            raise GptOssFp8Error(f"{reference}: has logits for {ref.logits.shape[0]} tokens, {tokens.numel()} given")
        if ref.rounding is not None and ref.rounding != rounding:
            ref.expected = ref.rounding = None  # made for another conversion: compare with the source only
        return ref
    if not reference.is_dir():
        raise GptOssFp8Error(f"{reference}: no such file or directory; pass the source checkpoint or a reference logits file")
    if tokens is None:
        raise GptOssFp8Error("no tokens: pass --tokens FILE or --prompt TEXT")
    import gc

    model = load_reference_model(reference, device)
    ref = run_reference_model(model, tokens, str(reference.resolve()))
    if rounding is not None:
        apply_rounding(model, rounding)
        ref.expected = run_reference_model(model, tokens, f"{ref.source} with {rounding.key()} weight rounding")
        ref.rounding = rounding
    del model
    gc.collect()  # free the reference's weights before our model loads
    return ref


# The fields of OpenAI's ModelConfig that must agree between a checkpoint and its reference (the
# rest, RoPE scaling and the SwiGLU limit, are compared too: see check_reference_matches).
_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_experts", "experts_per_token",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "sliding_window")


def _reference_config(reference: Path) -> dict | None:
    """The reference's model config as OpenAI's ModelConfig fields, or, for a reference file, what
    its tensors show (layers, vocab); None when it is neither (reference_for says so later)."""
    from gptoss_fp8.config import GptOssConfig, original_config_dict

    if reference.is_dir():
        if is_hf_mxfp4(reference):
            return original_config_dict(GptOssConfig.from_file(reference / "config.json"))
        for p in (reference, reference / "original"):
            if is_original(p):
                return _config_or_none(p)
        return None
    if not reference.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(reference), framework="pt") as f:
            keys = set(f.keys())
            vocab = f.get_slice("logits").get_shape()[-1] if "logits" in keys else None
    except Exception:
        return None  # not a safetensors file: load_reference_file gives the one-line error
    layers = {int(k.split(".")[1]) for k in keys if k.startswith("hidden.") and k.endswith(".attn")}
    d = {"vocab_size": vocab}
    if layers:
        d["num_hidden_layers"] = max(layers) + 1
    return d


def check_reference_matches(reference: Path, cfg, ckpt: Path) -> None:
    """One line, before any model runs, when ``reference`` is another model than the checkpoint's
    config (``cfg``, a GptOssConfig): every field that differs, named."""
    from gptoss_fp8.config import original_config_dict

    theirs = _reference_config(Path(reference))
    if not theirs:
        return
    ours = original_config_dict(cfg)
    keys = [k for k in ours if k in theirs and theirs[k] is not None]
    diff = [k for k in keys if (k in _SHAPE_KEYS and theirs[k] != ours[k])
            or (k not in _SHAPE_KEYS and isinstance(ours[k], (int, float)) and abs(float(theirs[k]) - float(ours[k])) > 1e-9)]
    if diff:
        what = ", ".join(f"{k} {theirs[k]} (reference) vs {ours[k]} (checkpoint)" for k in diff)
        raise GptOssFp8Error(f"--reference {reference} is another model than {ckpt}: {what}; "
                             "pass the source checkpoint this one was converted from (or its reference file)")

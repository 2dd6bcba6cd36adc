"""Open a gptoss-fp8 checkpoint in Hugging Face transformers: ``import gptoss_fp8.hf``, then
``AutoModelForCausalLM.from_pretrained(DST)`` returns a working ``GptOssForCausalLM``.

Why this is needed. ``config.json`` says ``quant_method: fp8`` (the HF convention), so plain
transformers routes the checkpoint to its own ``FineGrainedFP8HfQuantizer``, which cannot read our
layout: the experts are ``[E, out, in]`` FP8 with 128x128 block scales (its bf16 GptOss holds them
``[E, in, out]``), its FP8 experts have no bias, and its fallback dequantizer guesses the block
size from the scale grid, wrong for a partial last block (2880 = 22 x 128 + 64). Without the
import the load stops at once: ``Loading an FP8 quantized model requires accelerate`` when
accelerate is absent; with it, ``gate_up_proj_scale_inv`` UNEXPECTED and ``gate_up_proj`` MISMATCH
on CPU (it raises "You set `ignore_mismatched_sizes` to `False`"), ``FP8Experts`` "does not support
bias" on a GPU. (Any ``device_map`` needs accelerate in transformers, ours included.)

The hook: transformers' quantizer registry, under the ``quant_method`` our config.json writes.
``transformers.quantizers.auto.register_quantizer`` refuses a name that is taken ("fp8" is), so
the entry ``AUTO_QUANTIZER_MAPPING["fp8"]`` is replaced by ``GptOssFp8HfQuantizer``, a subclass of
transformers' own FP8 quantizer that takes over only pre-quantized ``gpt_oss`` checkpoints (which
transformers cannot load itself) and hands every other model to its parent unchanged. It uses the
public ``HfQuantizer`` methods only:

* a config hook (``update_attn_implementation`` in 5.23, ``update_tp_plan`` in 5.17; both see the
  model config before any weight file is looked for) decides whether the model is ours and checks
  the folder: ``conversion.json`` present, ours, this version, tp 1 (``open_for_transformers``),
  so a bad folder is one ``GptOssFp8Error`` line before anything is built or read;
* ``_process_model_before_weight_loading`` (the model is still on the meta device) re-registers the
  FP8 parameters in the checkpoint's own layout and dtype (``float8_e4m3fn [.., out, in]`` plus
  ``*_scale_inv`` float32), after checking that the model's parameters and the checkpoint's
  tensor table (layout.json, headers checked) agree one to one, so transformers' loader (its
  device_map, threads, safetensors) reads the bytes as they are: no key is UNEXPECTED or MISMATCHED;
* ``_process_model_after_weight_loading`` then does one of two things, by ``device_map``:
  - CPU (no device_map, "cpu"): converts those parameters to transformers' layout with our codec
    (``quant.fp8.dequantize_weight_blocks``: exact block scales, partial edge blocks) into the
    model's dtype, the experts transposed to ``[E, in, out]``; the quantization config is dropped
    (``dequantize``), so the result is a plain transformers GptOss (``save_pretrained`` writes bf16,
    PEFT and ``generate`` see ordinary parameters);
  - a CUDA device_map ("cuda", "cuda:N", N, or a dict naming one): the weights stay FP8 (the 20b
    ~21 GB resident instead of ~39 GB) and each attention projection becomes ``Fp8Linear``, each
    experts block ``Fp8Experts``, on the same tensors, run by our ops backend of the device
    (``fp8_ops``: ``TritonOps`` on CUDA, the ``kernels`` numerics: w8a8 block GEMMs, the fused
    MoE); attention runs our sink kernels through transformers' ``AttentionInterface`` (on CUDA,
    ``select_attention``: gptoss_fp8/hf_attention.py, eager where they do not apply); norms, rope,
    router and lm_head stay transformers' own.

Exactness (CPU): with ``--keep-attention-bf16`` (pow2 scales) every weight equals the MXFP4
source's, so the logits are transformers' on the source bit for bit (tests/test_hf.py). The
FP8-resident modules are tested on CPU with our CPU ops (the ``weights`` and ``w8a8`` specs) and
with the kernels through Triton's interpreter (slow); on a GPU only by tests/test_hf_gpu.py.

Not a pre-load weight converter (transformers' ``WeightConverter`` / ``ConversionOps``): their
signatures changed between 5.17 and 5.23 (``update_weight_conversions(conversions[, model])``,
``get_load_operations`` absent in 5.17), the two quantizer methods above did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gptoss_fp8 import __version__, hf_attention
from gptoss_fp8.checkpoint.checkpoint import Checkpoint
from gptoss_fp8.checkpoint.format import LAYOUT_NAME, REPORT_NAME
from gptoss_fp8.checkpoint.manifest import check_rank_files
from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.quant.fp8 import FP8_DTYPE, dequantize_weight_blocks

try:
    from transformers.quantizers import auto as _auto
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
except ImportError:  # pragma: no cover - exercised only without the extra
    raise GptOssFp8Error("gptoss_fp8.hf needs transformers: pip install 'gptoss-fp8[hf]'") from None

# The FP8 tensors of a converted checkpoint and how transformers' GptOss holds each one:
# checkpoint name suffix -> True if transformers stores it transposed ([E, in, out]; its experts
# compute x @ W), False if as is ([out, in]; nn.Linear). Every FP8 tensor's scale is NAME + "_scale_inv".
HF_TRANSPOSED: dict[str, bool] = {
    "mlp.experts.gate_up_proj": True,  # file [E, 2I, H] rows interleaved gate/up -> [E, H, 2I], columns interleaved
    "mlp.experts.down_proj": True,  # file [E, H, I] -> [E, I, H]
    "self_attn.q_proj.weight": False,
    "self_attn.k_proj.weight": False,
    "self_attn.v_proj.weight": False,
    "self_attn.o_proj.weight": False,
}
SCALE_SUFFIX = "_scale_inv"


def _transposed(name: str) -> bool:
    for suffix, t in HF_TRANSPOSED.items():
        if name.endswith("." + suffix):
            return t
    raise GptOssFp8Error(f"tensor {name} is FP8 but is not one gptoss-fp8 converts; the checkpoint was not "
                         "written by gptoss-fp8 convert")


def open_for_transformers(root: str | Path) -> Checkpoint:
    """The converted checkpoint at ``root``, checked for loading into transformers: written by
    this version of gptoss-fp8 (conversion.json), complete (layout.json) and unsharded (tp 1,
    ep 1). One ``GptOssFp8Error`` line otherwise, naming the folder and what to do."""
    root = Path(root)
    if not (root / REPORT_NAME).is_file():
        raise GptOssFp8Error(f"{root}: no {REPORT_NAME}, so not a checkpoint written by gptoss-fp8 convert (or an "
                             f"incomplete one); convert the MXFP4 source: gptoss-fp8 convert SRC {root}")
    ckpt = Checkpoint.open(root)
    rec = ckpt.conversion
    if rec is None or rec.get("tool") != "gptoss-fp8":
        raise GptOssFp8Error(f"{root / REPORT_NAME}: not a gptoss-fp8 conversion record; convert the MXFP4 source: "
                             f"gptoss-fp8 convert SRC {root}")
    if rec.get("version") != __version__:
        raise GptOssFp8Error(f"{root}: converted by gptoss-fp8 {rec.get('version')}, this is {__version__}; convert "
                             f"again with this version (gptoss-fp8 convert SRC {root} --overwrite)")
    if (ckpt.tp, ckpt.ep) != (1, 1):
        raise GptOssFp8Error(f"{root}: converted for --tp {ckpt.tp} --ep {ckpt.ep} (one folder per rank); transformers "
                             "loads one unsharded checkpoint: convert at --tp 1 for this path (gptoss-fp8 convert SRC DST)")
    if ckpt.manifest is None:
        raise GptOssFp8Error(f"{root}: no {LAYOUT_NAME}; the conversion is incomplete, finish it with gptoss-fp8 "
                             f"convert SRC {root} --resume")
    return ckpt


@dataclass
class _Fp8Param:
    """One FP8 parameter re-registered on a module for the load, and what it becomes after it."""
    module: nn.Module
    path: str  # the module's name in the model ("model.layers.0.mlp.experts")
    attr: str  # "gate_up_proj", "weight", ...
    dtype: torch.dtype  # the model's dtype for it (what transformers built)
    transposed: bool


def storage_layout(model: nn.Module, ckpt: Checkpoint) -> list[_Fp8Param]:
    """Re-register every FP8 tensor of ``ckpt`` on ``model`` (a transformers GptOss on the meta
    device) as the checkpoint holds it, plus its ``*_scale_inv``; check that the model's parameters
    and the checkpoint's tensors then match one to one in names and shapes (the FP8 ones in dtype
    too). Returns what ``to_transformers_layout`` / ``to_fp8_modules`` take after the load."""
    infos = check_rank_files(ckpt.path, ckpt.manifest, 0, verify=False)  # sizes and headers vs layout.json
    params = dict(model.named_parameters())
    out = []
    for name, info in sorted(infos.items()):
        if info.dtype != FP8_DTYPE:
            continue
        transposed = _transposed(name)
        scale = infos.get(name + SCALE_SUFFIX)
        if scale is None:
            raise GptOssFp8Error(f"{info.file}: FP8 tensor {name} has no {name + SCALE_SUFFIX}; re-run the conversion")
        held = params.get(name)
        want = tuple(info.shape[:-2]) + ((info.shape[-1], info.shape[-2]) if transposed else tuple(info.shape[-2:]))
        if held is None or tuple(held.shape) != want:
            got = "no such parameter" if held is None else f"holds {list(held.shape)}"
            raise GptOssFp8Error(f"{info.file}: tensor {name} {list(info.shape)} does not fit transformers' GptOss built "
                                 f"from config.json ({got}); is config.json the one the weights were converted with?")
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        dev = held.device
        setattr(module, attr, nn.Parameter(torch.empty(info.shape, dtype=FP8_DTYPE, device=dev), requires_grad=False))
        module.register_parameter(attr + SCALE_SUFFIX, nn.Parameter(
            torch.empty(scale.shape, dtype=torch.float32, device=dev), requires_grad=False))
        out.append(_Fp8Param(module, mod_name, attr, held.dtype, transposed))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name in sorted(set(shapes) | set(infos)):
        if name not in infos:
            raise GptOssFp8Error(f"{ckpt.path}: transformers' GptOss has {name}, the checkpoint has no such tensor; "
                                 "re-run the conversion")
        if name not in shapes or shapes[name] != tuple(infos[name].shape):
            raise GptOssFp8Error(f"{infos[name].file}: tensor {name} {list(infos[name].shape)} has no place in "
                                 "transformers' GptOss built from config.json; is config.json the one the weights "
                                 "were converted with?")
    return out


@torch.no_grad()
def to_transformers_layout(params: list[_Fp8Param]) -> None:
    """After the load: each FP8 parameter and its block scales -> the model's dtype with our codec
    (``W.float() * scale_inv`` of its 128x128 block, edge blocks partial), in transformers' layout
    (experts transposed to [E, in, out]); the scale parameters are removed. One expert at a time,
    so the float32 intermediate is one expert's."""
    for p in params:
        w, s = getattr(p.module, p.attr), getattr(p.module, p.attr + SCALE_SUFFIX)
        if p.transposed:  # [E, out, in] -> [E, in, out]
            e, n, k = w.shape
            out = torch.empty((e, k, n), dtype=p.dtype, device=w.device)
            for i in range(e):
                out[i] = dequantize_weight_blocks(w[i], s[i], p.dtype).t()
        else:
            out = dequantize_weight_blocks(w, s, p.dtype)
        delattr(p.module, p.attr + SCALE_SUFFIX)
        setattr(p.module, p.attr, nn.Parameter(out, requires_grad=out.is_floating_point()))


# ------------------------------------------------------------------------------------------------
# The FP8-resident path (CUDA): the weights stay as the checkpoint holds them and run on an ops
# backend of ours (model/ops.py: the same calls our model makes): on a GPU ``TritonOps`` (the
# ``kernels`` numerics: w8a8 block GEMMs, the fused MoE), on CPU ``W8A8CpuOps`` (the w8a8 spec the
# kernels are tested against). Norms, rope, router and lm_head stay transformers' own; attention
# is ours on CUDA (``select_attention``), transformers' eager elsewhere.


def fp8_ops(device: torch.device):
    """The ops backend for FP8-resident modules on ``device``: TritonOps on CUDA, else the w8a8 spec."""
    from gptoss_fp8.model.backends import get_ops

    return get_ops("triton" if device.type == "cuda" else "w8a8")


def wants_fp8_resident(device_map) -> bool:
    """Whether ``from_pretrained``'s device_map puts weights on a CUDA device (then they stay FP8):
    "cuda", "cuda:N", an int, a torch.device, "auto"-style strings with a GPU visible, or a dict
    with any of those. None (the default: CPU) and "cpu" dequantize."""
    if isinstance(device_map, dict):
        return any(wants_fp8_resident(v) for v in device_map.values())
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return True
    if isinstance(device_map, torch.device):
        return device_map.type == "cuda"
    if isinstance(device_map, str):
        if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            return torch.cuda.is_available()
        return device_map.startswith("cuda")
    return False


class Fp8Linear(nn.Module):
    """``nn.Linear``'s contract (x [..., in] -> [..., out]) on an FP8 weight [out, in] with its
    128x128 block scales (float32 [ceil(out/128), ceil(in/128)]) and bf16 bias, by ``ops.linear``."""

    def __init__(self, weight: nn.Parameter, weight_scale_inv: nn.Parameter, bias: nn.Parameter | None, ops):
        super().__init__()
        self.weight, self.weight_scale_inv, self.bias = weight, weight_scale_inv, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.ops = ops  # not a submodule: one backend object shared by the model's FP8 modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


class Fp8Experts(nn.Module):
    """``GptOssExperts``' contract (hidden bf16 [T, H], router_indices [T, k], routing_weights [T, k]
    -> [T, H]) on FP8 experts in the checkpoint's layout (gate_up_proj [E, 2I, H], down_proj
    [E, H, I], block scales, bf16 biases), by ``ops.expert_ffn`` then ``ops.moe_combine``."""

    NAMES = ("gate_up_proj", "gate_up_proj_scale_inv", "gate_up_proj_bias",
             "down_proj", "down_proj_scale_inv", "down_proj_bias")

    def __init__(self, experts: nn.Module, ops):
        super().__init__()
        for n in self.NAMES:
            setattr(self, n, getattr(experts, n))
        self.num_experts, self.limit = experts.num_experts, experts.limit
        self.ops = ops

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        experts = {n: getattr(self, n) for n in self.NAMES}
        y, _ = self.ops.expert_ffn(hidden_states, router_indices, experts, 0, self.limit)  # [T, k, H]
        return self.ops.moe_combine(y, routing_weights.to(torch.bfloat16)).to(hidden_states.dtype)


def to_fp8_modules(model: nn.Module, params: list[_Fp8Param]) -> None:
    """After the load: each module holding FP8 parameters is replaced by ``Fp8Linear`` /
    ``Fp8Experts`` on the same tensors (no copy), run by ``fp8_ops`` of their device."""
    done: set[str] = set()
    ops = {}
    for p in params:
        if p.path in done:
            continue
        done.add(p.path)
        dev = getattr(p.module, p.attr).device
        op = ops.setdefault(dev, fp8_ops(dev))
        new = Fp8Experts(p.module, op) if p.transposed else Fp8Linear(
            p.module.weight, p.module.weight_scale_inv, p.module.bias, op)
        parent, _, child = p.path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def kernel_attention_device(device: torch.device) -> bool:
    """Whether an FP8-resident model whose weights are on ``device`` gets our attention kernels:
    CUDA only (on CPU, even under Triton's interpreter, the model keeps transformers' eager)."""
    return torch.device(device).type == "cuda"


def select_attention(model: nn.Module, device: torch.device) -> bool:
    """After an FP8-resident load on ``device``: switch the model to ``hf_attention.NAME`` (our
    prefill / decode kernels, eager where they do not apply) when ``kernel_attention_device`` says
    so and the model is on transformers' default (eager: GptOss has no sdpa); an implementation the
    user asked for (``attn_implementation=`` a hub kernel, sdpa, ...) is kept. ``model.set_attn_implementation("eager")``
    goes back. Returns whether it switched."""
    if not kernel_attention_device(device) or model.config._attn_implementation not in (None, "eager"):
        return False
    model.set_attn_implementation(hf_attention.NAME)
    return True


class GptOssFp8HfQuantizer(FineGrainedFP8HfQuantizer):
    """transformers' FP8 quantizer, but a pre-quantized ``gpt_oss`` checkpoint is read as
    gptoss-fp8 writes it (module docstring). Any other model (and quantizing on the fly) goes to
    the parent unchanged; its ``validate_environment`` only runs once that is known."""

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._ours: bool | None = None  # decided from the model config (``_decide``)
        self._env: tuple[tuple, dict] = ((), {})
        self._fp8: list[_Fp8Param] = []
        self.fp8_resident = False  # weights kept FP8 on our ops (a CUDA device_map) instead of dequantized

    # --- deciding, and checking the folder before anything is read -----------------------------
    def validate_environment(self, *args, **kwargs):
        self._env = (args, kwargs)  # the parent's checks (accelerate, a GPU) are for its own models only

    def _decide(self, config) -> bool:
        if self._ours is None:
            self._ours = self.pre_quantized and getattr(config, "model_type", None) == "gpt_oss"
            if self._ours:
                name = str(getattr(config, "name_or_path", "") or "")
                if not Path(name).is_dir():
                    # transformers would fetch only config and weights; our records (conversion.json,
                    # layout.json) are what make the checks above possible
                    raise GptOssFp8Error(f"{name}: gptoss_fp8.hf loads a converted checkpoint from a local folder; "
                                         f"download it first (hf download {name} --local-dir DIR) and pass DIR")
                open_for_transformers(name)
                # on CPU the weights are converted to the model's dtype after the load: no longer quantized
                self.fp8_resident = wants_fp8_resident(self._env[1].get("device_map"))
                self.quantization_config.dequantize = not self.fp8_resident
            else:
                super().validate_environment(*self._env[0], **self._env[1])
        return self._ours

    def update_attn_implementation(self, config):  # transformers 5.23: sees the config before any file
        if self._decide(config):
            return config
        parent = getattr(super(), "update_attn_implementation", None)
        return parent(config) if parent is not None else config

    def update_tp_plan(self, config):  # transformers 5.17's config hook at the same point
        if self._decide(config):
            return config
        parent = getattr(super(), "update_tp_plan", None)
        return parent(config) if parent is not None else config

    # --- the load --------------------------------------------------------------------------------
    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self._decide(model.config):
            return False
        return super().param_needs_quantization(model, param_name, **kwargs)

    def _process_model_before_weight_loading(self, model, **kwargs):
        if not self._decide(model.config):
            return super()._process_model_before_weight_loading(model, **kwargs)
        files = kwargs.get("checkpoint_files") or []
        if not files:
            raise GptOssFp8Error(f"{model.config.name_or_path}: no weight files found; point at a converted checkpoint")
        ckpt = open_for_transformers(Path(files[0]).parent)
        self._fp8 = storage_layout(model, ckpt)
        return model

    def update_weight_conversions(self, weight_conversions, *args, **kwargs):
        if self._ours:  # names and layout are the checkpoint's: transformers' own FP8 renames must not apply
            return weight_conversions
        return super().update_weight_conversions(weight_conversions, *args, **kwargs)

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self._ours:
            return super()._process_model_after_weight_loading(model, **kwargs)
        if self.fp8_resident:
            device = getattr(self._fp8[0].module, self._fp8[0].attr).device if self._fp8 else torch.device("cpu")
            to_fp8_modules(model, self._fp8)
            select_attention(model, device)
        else:
            to_transformers_layout(self._fp8)
        self._fp8 = []
        return model

    def is_serializable(self):
        return not (self._ours and self.fp8_resident)  # FP8-resident: saving it back is not built (nor tested)

    @property
    def is_trainable(self) -> bool:
        return not (self._ours and self.fp8_resident)


def register() -> None:
    """Make transformers' ``quant_method: fp8`` go through ``GptOssFp8HfQuantizer`` (idempotent;
    done on import)."""
    _auto.AUTO_QUANTIZER_MAPPING["fp8"] = GptOssFp8HfQuantizer


register()

"""verify-logits modes: which ops backend computes each, where it can run, and what it really ran.

==========  ===========  =========================================================================
mode        ops backend  what it computes
==========  ===========  =========================================================================
weights     reference    FP8 weights dequantized, bf16 activations, OpenAI's op order (torch)
w8a8        w8a8-cpu     the w8a8 executable specification in torch (FP8 activations in 1x128
                         groups, fp32 accumulation), on --device (the name says it is the spec,
                         not that it runs on the CPU)
kernels     triton       the same w8a8 numerics computed by our Triton kernels (model/triton_ops.py):
                         what serving runs; needs CUDA, or Triton's interpreter on CPU (slow, tests)
==========  ===========  =========================================================================

``--mode auto`` (the default) runs ``weights`` and ``w8a8``, plus ``kernels`` when the device is
CUDA: on a GPU the kernels are checked against OpenAI's reference and against their own spec.

``TritonOps`` hands an op to the spec (its parent class) when the kernels cannot take it (a shape
or dtype outside their limits, tensors on a device no kernel runs on); gpt-oss's own shapes need
none of that. So that a report never claims kernels that did not run, the backend counts each
hand-over itself: ``ops.spec_fallbacks`` (op -> calls, every op it has a kernel for, zeros
included; ``linears``, which only dispatches to ``linear``, is counted where it lands), which the
report carries. bf16 GEMMs (lm_head, attention kept bf16) are torch by design in every backend and
are not counted; the router's bf16 GEMM is part of ``route`` (a kernel in the triton backend,
counted when handed over). The CPU backends are the spec: their ``spec_fallbacks`` is None.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from gptoss_fp8.errors import GptOssFp8Error
from gptoss_fp8.model.backends import get_ops
from gptoss_fp8.model.ops import ReferenceOps

MODES: dict[str, str] = {"weights": "reference", "w8a8": "w8a8-cpu", "kernels": "triton"}  # mode -> ops backend
ORDER = tuple(MODES)
SHORTHANDS: dict[str, tuple[str, ...]] = {"both": ("weights", "w8a8"), "all": ORDER}


def kernels_unavailable(device: str) -> str | None:
    """Why the ``kernels`` mode cannot run on ``device`` (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "--mode kernels needs Triton: pip install triton==3.6.0 (the version the kernels are tested with)"
    if device.startswith("cuda"):
        return None if torch.cuda.is_available() else f"--device {device}: no CUDA GPU is visible; use --device cpu"
    # model/triton_ops.interpreter_on, without importing triton: Triton decides interpreter or not
    # for its own library functions when first imported, so a check must not be that import.
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return (f"--mode kernels runs our Triton kernels, which need --device cuda (on {device} they run only in "
            "Triton's interpreter: TRITON_INTERPRET=1 in the environment, slow, meant for tests); "
            "on CPU use --mode w8a8, the same numerics in torch")


def resolve_modes(requested: list[str] | None, device: str) -> list[str]:
    """Modes to run, in report order, from ``--mode`` values (repeatable; ``auto``, ``both`` and ``all``
    expand). Raises GptOssFp8Error for an unknown mode, or one that cannot run on ``device``."""
    want: set[str] = set()
    for m in requested or ["auto"]:
        if m == "auto":
            want |= {"weights", "w8a8"} | ({"kernels"} if device.startswith("cuda") else set())
        elif m in SHORTHANDS:
            want |= set(SHORTHANDS[m])
        elif m in MODES:
            want.add(m)
        else:
            raise GptOssFp8Error(f"unknown mode {m!r}; choose from auto, {', '.join(ORDER)}, {', '.join(SHORTHANDS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptOssFp8Error(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    if "kernels" in want and (why := kernels_unavailable(device)):
        raise GptOssFp8Error(why)
    return [m for m in ORDER if m in want]


def backend_device(mode: str, device: str) -> str:
    """Where a mode's ops ran, in words for the report: ``cuda``, ``cpu``, ``cpu, Triton interpreter``."""
    if MODES[mode] == "triton":
        from gptoss_fp8.model.triton_ops import interpreter_on

        if interpreter_on():
            return f"{device}, Triton interpreter"
    return device


# ----------------------------------------------------------------------------------------------
# Ops objects


def ops_for(mode: str, gemm: str = "ours", attention: str = "bf16", attention_backend: str = "ours",
            kernel_options: tuple[str, ...] = ()) -> ReferenceOps:
    """A fresh ops object for ``mode`` (the ``kernels`` one counts its hand-overs to the spec in
    ``spec_fallbacks``, see the module docstring). ``gemm``: the kernels mode's GEMM library,
    ``KernelConfig.gemm`` ("ours", or "deep_gemm": kernels/deepgemm.py); ``attention``: the
    prefill attention's numerics, "bf16" or "fp8" (``ReferenceOps.with_attention``);
    ``attention_backend``: the kernels mode's prefill attention library,
    ``KernelConfig.attention_backend`` ("ours", or "flashinfer": kernels/flashinfer_attention.py);
    ``kernel_options``: NAME=VALUE settings of the kernels mode's ``KernelConfig`` (``with_options``,
    ``check_kernel_options``)."""
    if MODES[mode] == "triton" and (gemm != "ours" or attention_backend != "ours" or kernel_options):
        from dataclasses import replace

        from gptoss_fp8.kernels.config import with_options
        from gptoss_fp8.model.triton_ops import TritonOps, default_config

        config = with_options(replace(default_config(), gemm=gemm, attention_backend=attention_backend),
                              list(kernel_options))
        return TritonOps(config=config).with_attention(attention)
    return get_ops(MODES[mode], attention)


def _check_backend(option: str, value: str, modes: list[str], choices: tuple[str, ...], module: str) -> None:
    """A library option other than "ours": known, used by the run (the kernels mode), importable
    (kernels/<module>.py's ``require``). Raises GptOssFp8Error (one line) before any model runs."""
    if value not in choices:
        raise GptOssFp8Error(f"{option} {value!r}: choose one of {', '.join(choices)}")
    if "kernels" not in modes:
        raise GptOssFp8Error(f"{option} {value} changes the kernels mode only, which this run does not include "
                             f"({', '.join(modes)}); add --mode kernels (needs --device cuda)")
    importlib.import_module(f"gptoss_fp8.kernels.{module}").require()


def check_gemm(gemm: str, modes: list[str]) -> None:
    """``--gemm`` (``_check_backend``). "ours" imports nothing (a CPU run stays free of Triton, which
    kernels/config.py imports)."""
    if gemm != "ours":
        from gptoss_fp8.kernels.config import GEMM_BACKENDS

        _check_backend("--gemm", gemm, modes, GEMM_BACKENDS, "deepgemm")


def check_kernel_options(options: list[str] | None, modes: list[str]) -> None:
    """``--kernel-option``: each parses onto the kernels' ``KernelConfig`` (``with_options``) and the run has the
    kernels mode. Raises GptOssFp8Error (one line) before any model runs."""
    if not options:
        return
    if "kernels" not in modes:
        raise GptOssFp8Error(f"--kernel-option changes the kernels mode only, which this run does not include "
                             f"({', '.join(modes)}); add --mode kernels (needs --device cuda)")
    from gptoss_fp8.kernels.config import KernelConfig, with_options

    try:
        with_options(KernelConfig(), options)
    except ValueError as err:
        raise GptOssFp8Error(f"--kernel-option {err}") from None


def check_attention_backend(attention_backend: str, modes: list[str]) -> None:
    """``--attention-backend`` (``_check_backend``); "ours" imports nothing."""
    if attention_backend != "ours":
        from gptoss_fp8.kernels.config import ATTENTION_BACKENDS

        _check_backend("--attention-backend", attention_backend, modes, ATTENTION_BACKENDS, "flashinfer_attention")


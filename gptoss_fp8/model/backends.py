"""The ops backends by name: the one place that knows all of them (ops.py's CPU backends and the
GPU one in triton_ops.py, imported only when asked for, so the torch spec runs without Triton)."""

from __future__ import annotations

from gptoss_fp8.model.ops import MODES, ReferenceOps, W8A8CpuOps


def get_ops(name: str, attention: str = "bf16") -> ReferenceOps:
    """Backend by name: ``reference`` / ``weights``, ``w8a8-cpu`` / ``w8a8``, or ``triton``;
    ``attention``: the prefill attention's numerics (``ReferenceOps.with_attention``)."""
    name = MODES.get(name, name)
    if name == "reference":
        return ReferenceOps().with_attention(attention)
    if name == "w8a8-cpu":
        return W8A8CpuOps().with_attention(attention)
    if name == "triton":  # the GPU kernels (the only import of Triton from the model, and a lazy one)
        from gptoss_fp8.model.triton_ops import TritonOps

        return TritonOps().with_attention(attention)
    raise ValueError(f"unknown ops backend {name!r}")

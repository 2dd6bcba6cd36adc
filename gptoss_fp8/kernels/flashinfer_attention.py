"""The optional FlashInfer backend of the bf16 prefill attention (``KernelConfig.attention_backend =
"flashinfer"``, issue 34).

FlashInfer (flashinfer-python 0.7.2; on the GPU machine the slim tree .fi/ that
benchmarks/flashinfer_slim.py builds) is used when importable, never required: ``available()``
imports it lazily once and never raises; ``require()`` raises one GptOssFp8Error line saying how
to get it.

``prefill(q [T, Hq, D] bf16, k, v [T, Hkv, D] bf16, sinks [Hq], sm_scale, window, cu_seqlens, out)``
-> [T, Hq, D] bf16: ``spec.attention_varlen``'s function (causal, per-head sinks as an extra softmax
column, GQA, optional sliding window) on FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` with
``jit_args`` naming its ``AttentionSink`` variant (jit/attention/variants.py: exp(sink - m) added
to each row's denominator, the sink in natural log and not scaled by sm_scale, as the spec), the
recipe of benchmarks/flashinfer_peer.py. qo_indptr = kv_indptr = cu_seqlens (None: [0, T]): a
ragged batch is ONE launch, which our Gluon kernel cannot do (it takes one sequence; our ragged
batches run the Triton kernel). Backend "fa3" on sm_90, "fa2" elsewhere. head_dim 64, 128 or 256.

Not here, by design (TritonOps routes these to our kernels, model/triton_ops.py): FP8 attention
(``attention_kind="fp8"``: FlashInfer's sink variant is bf16), a prompt chunk after cached keys
(``q_offset`` > 0) and decode (our kernels read the KV cache as it lies), other head dims.

Window: ``spec.attention`` shows key j to query i iff j <= i and i - window < j (``window`` keys,
the query's own included); FlashInfer keeps j iff i - window_left <= j <= i (fa2's
``kv_idx + qo_len + window_left >= kv_len + qo_idx`` and fa3's ``col_limit_left`` at qo_len =
kv_len), ``window_left`` + 1 keys: so ``window_left = window - 1`` (``window_left``).

Caching: one workspace (256 MiB, FlashInfer's split-KV scratch, used only inside a run; runs are
ordered on the stream) per device, shared by the wrappers; one wrapper per (device, backend,
windowed, Hq, Hkv, D); ``plan()`` (which reads the indptr on the host: a sync) re-run only when its
key changes: the lengths (one sequence: T, no host read; a ragged batch: cu_seqlens read to the
host, one small copy a call) and window_left. A CUDA graph replays the plan current at replay time
(FlashInfer's plan lives in its buffers): capture and replay at the lengths of one plan.

JIT: a wrapper's first construction for a (backend, windowed, D) builds FlashInfer's module with
nvcc and ninja (~85 s per module on the GPU machine; a model with sliding layers needs two: with
and without the window), cached on disk under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (/tmp
when unset, as the peer script) and loaded from there later. When the CUDA toolkit lacks
curand_kernel.h (cutlass's tensor_fill.h includes it), pip's nvidia-curand headers are added to
FLASHINFER_EXTRA_CUDAFLAGS. ``clear_cache()`` drops the wrappers and workspaces (not the disk cache).
"""

from __future__ import annotations

import functools
import os

import torch

from gptoss_fp8.errors import GptOssFp8Error

HEAD_DIMS = (64, 128, 256)  # the head dims FlashInfer's prefill kernels are built for
WORKSPACE_BYTES = 256 << 20
HOW_TO_GET = ("on the GPU machine carry .fi/ (benchmarks/flashinfer_slim.py builds it from the flashinfer-python "
              "0.7.2 wheels) and run with PATH=$PATH:$PWD/.fi/bin PYTHONPATH=$PYTHONPATH:$PWD/.fi "
              "(benchmarks/gpu_suite.sh flashinfer), or pip install flashinfer-python; or use --attention-backend ours")


# ------------------------------------------------------------------------------------------------
# Availability


@functools.cache
def _load():
    """(the flashinfer module, "") or (None, why not): imported once."""
    # read when flashinfer is imported: the JIT cache's root; tvm_ffi builds no torch DLPack addon
    # (torch has the API)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp")
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    try:
        import flashinfer
        from flashinfer.jit.attention.variants import attention_sink_decl  # noqa: F401 - the variant used here
    except Exception as e:  # noqa: BLE001 - any failure to import (missing, broken CUDA setup) means "not available"
        return None, f"{type(e).__name__}: {e}"
    if not hasattr(flashinfer, "BatchPrefillWithRaggedKVCacheWrapper"):
        return None, f"the flashinfer at {getattr(flashinfer, '__file__', '?')} has no BatchPrefillWithRaggedKVCacheWrapper"
    return flashinfer, ""


def available() -> bool:
    """Whether ``import flashinfer`` works and has the ragged prefill and its sink variant (cached; never raises)."""
    return _load()[0] is not None


def require():
    """The flashinfer module, or GptOssFp8Error (one line: why, and how to get it)."""
    mod, why = _load()
    if mod is None:
        raise GptOssFp8Error(f"attention backend 'flashinfer' (--attention-backend flashinfer / "
                             f"KernelConfig.attention_backend) needs FlashInfer, which is not importable "
                             f"({' '.join(why.split())}); {HOW_TO_GET}")
    return mod


# ------------------------------------------------------------------------------------------------
# Pure mappings


def window_left(window: int | None) -> int:
    """FlashInfer's ``window_left`` for ``spec.attention``'s ``window`` (None or 0: none, -1); the
    module docstring derives window - 1."""
    if window is None or window == 0:
        return -1
    if not isinstance(window, int) or window < 0:
        raise GptOssFp8Error(f"flashinfer prefill: window {window!r} must be None or an int >= 0")
    return window - 1


def backend_for(device: torch.device) -> str:
    """FlashInfer's backend on ``device``: "fa3" (Hopper's kernels) on sm_90, else "fa2"."""
    return "fa3" if torch.cuda.get_device_capability(device) == (9, 0) else "fa2"


# ------------------------------------------------------------------------------------------------
# Wrappers, built and planned once


class _Planned:
    """A wrapper and the key of its last plan() (None: never planned)."""

    def __init__(self, wrapper):
        self.wrapper, self.key = wrapper, None


_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_WRAPPERS: dict[tuple, _Planned] = {}


def clear_cache() -> None:
    """Drop every wrapper and workspace (the JIT modules on disk stay)."""
    _WRAPPERS.clear()
    _WORKSPACES.clear()


def _curand_flags() -> None:
    """cutlass's tensor_fill.h includes curand_kernel.h: when the toolkit lacks it, the headers of
    pip's nvidia-curand (cu13), searched after the toolkit's (benchmarks/flashinfer_peer.py)."""
    from flashinfer.jit.cpp_ext import get_cuda_path

    if os.path.exists(os.path.join(get_cuda_path(), "include", "curand_kernel.h")):
        return
    try:
        import nvidia
    except ImportError:  # no pip CUDA packages: nvcc reports the missing header itself
        return
    inc = [p for d in nvidia.__path__ if os.path.exists(p := os.path.join(d, "cu13", "include", "curand_kernel.h"))]
    if inc:
        os.environ.setdefault("FLASHINFER_EXTRA_CUDAFLAGS", f"-isystem {os.path.dirname(inc[0])}")


def _wrapper(device: torch.device, windowed: bool, hq: int, hkv: int, d: int) -> _Planned:
    """The cached wrapper of (device, backend, windowed, hq, hkv, d); the first one of a (backend,
    windowed, d) JIT-builds FlashInfer's module (module docstring)."""
    backend = backend_for(device)
    key = (device, backend, windowed, hq, hkv, d)
    if key not in _WRAPPERS:
        fi = require()
        from flashinfer.jit.attention.variants import attention_sink_decl

        _curand_flags()
        ws = _WORKSPACES.setdefault(device, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
        bf16 = torch.bfloat16
        # (uri, q / kv / o dtypes, index dtype, head dims qk / vo, the variant's extra tensor and
        # scalar parameters with their C types, the variant's name and its C++ declaration)
        jit_args = [f"gptoss_fp8_sink_bf16_d{d}_swa{int(windowed)}_{backend}", bf16, bf16, bf16, torch.int32, d, d,
                    ["sink"], ["float"], ["sm_scale"], ["double"], "AttentionSink", attention_sink_decl[backend]]
        jit_kwargs = {"use_sliding_window": windowed,  # a template argument of the module
                      "paged_kv_stride_mode": "independent" if backend == "fa2" else "runtime"}
        _WRAPPERS[key] = _Planned(fi.BatchPrefillWithRaggedKVCacheWrapper(
            ws, "NHD", backend=backend, jit_args=jit_args, jit_kwargs=jit_kwargs))
    return _WRAPPERS[key]


# ------------------------------------------------------------------------------------------------
# The call


def _check(q, k, v, sinks, cu_seqlens, out) -> None:
    """One GptOssFp8Error line for input ``prefill`` cannot take."""
    def bad(what):
        raise GptOssFp8Error(f"flashinfer prefill: {what}")

    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        bad(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want q [T, Hq, D], k and v [T, Hkv, D]")
    T, hq, d = q.shape
    if hq % k.shape[1]:
        bad(f"{hq} query heads are not a multiple of {k.shape[1]} kv heads")
    if d not in HEAD_DIMS:
        bad(f"head_dim {d}: FlashInfer's prefill takes {', '.join(map(str, HEAD_DIMS))}; use our kernels")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16 or t.device.type != "cuda" or t.device != q.device:
            bad(f"{name} is {t.dtype} on {t.device}: want bfloat16 on q's CUDA device ({q.device})")
        # rows and heads by stride (views of the fused q/k/v output are fine), 16-byte aligned (TMA / cp.async)
        if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8:
            bad(f"{name} strides {t.stride()}: want a contiguous last dim and row / head strides of 8k elements")
    if sinks.shape != (hq,) or not sinks.is_floating_point() or sinks.device != q.device:
        bad(f"sinks {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}: want ({hq},) floating point on {q.device}")
    if cu_seqlens is not None and (cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        bad(f"cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}: want int32 [B+1], B >= 1")
    if out is not None and (out.shape != q.shape or out.dtype != torch.bfloat16 or out.device != q.device):
        bad(f"out {tuple(out.shape)} {out.dtype} on {out.device}: want {tuple(q.shape)} bfloat16 on {q.device}")


def _lengths_key(cu_seqlens: torch.Tensor | None, T: int) -> tuple[int, ...]:
    """The plan's lengths: (0, T) for one sequence (no host read), else cu_seqlens read to the host
    (checked: starts at 0, non-decreasing, ends at T)."""
    if cu_seqlens is None:
        return (0, T)
    cu = tuple(cu_seqlens.tolist())
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise GptOssFp8Error(f"flashinfer prefill: cu_seqlens {list(cu)[:8]}{'...' if len(cu) > 8 else ''} must rise "
                             f"from 0 to T = {T}")
    return cu


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, sm_scale: float | None = None,
            window: int | None = None, cu_seqlens: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with sinks of one sequence (cu_seqlens None) or a ragged batch (int32 [B+1],
    each sequence from position 0) on FlashInfer: ``spec.attention_varlen(q, k, v, sinks, cu_seqlens,
    sm_scale, window)`` with fp32 softmax. sm_scale None: 1 / sqrt(D); window None / 0: full causal.
    Returns ``out`` (or a new tensor) [T, Hq, D] bf16. The first call of a (backend, windowed, D)
    JIT-builds FlashInfer's module (module docstring)."""
    _check(q, k, v, sinks, cu_seqlens, out)
    T, hq, d = q.shape
    if T == 0:
        return q.new_empty(q.shape) if out is None else out
    wl = window_left(window)
    lengths = _lengths_key(cu_seqlens, T)
    planned = _wrapper(q.device, wl >= 0, hq, k.shape[1], d)
    if planned.key != (lengths, wl):
        indptr = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        planned.wrapper.plan(indptr, indptr, hq, k.shape[1], d, causal=True, window_left=wl,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        planned.key = (lengths, wl)
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    return planned.wrapper.run(q, k, v, sinks.float().contiguous(), scale, out=out)

"""Attention with sinks on our kernels inside transformers' GptOss (the FP8-resident CUDA load of
``gptoss_fp8.hf`` selects it; transformers' eager attention materializes T x T scores).

The hooks are transformers' public registries, identical in 5.17 and 5.23:

* ``AttentionInterface.register("gptoss_fp8", attention_forward)``: called by ``GptOssAttention``
  as ``f(module, query [B, Hq, Tq, D], key / value [B, Hkv, Tk, D] (rotated, after the cache's
  update), attention_mask, dropout=, scaling=, sliding_window=, s_aux=sinks [Hq])`` and returns
  ``(out [B, Tq, Hq, D], None)``;
* ``AttentionMaskInterface.register("gptoss_fp8", mask)``: what ``create_causal_mask`` /
  ``create_sliding_window_causal_mask`` hand to the attention under that name. When the mask is
  the plain pattern our kernels implement themselves (transformers' own causal, or sliding-window
  causal with the layer's window; the queries are the last Tq positions of the keys; no padding:
  the 2D ``attention_mask`` is absent or all ones over the keys) it returns a ``PlainMask`` (the
  sizes, nothing materialized); otherwise exactly ``eager_mask(**kwargs)``, eager's float mask.

``attention_forward`` runs a kernel only on a ``PlainMask`` whose sizes and window are this call's,
bf16 q/k/v on a device Triton takes (CUDA; CPU under ``TRITON_INTERPRET=1``, the tests), head_dim a
power of two in 16..256, sinks given, no gradient wanted and no dropout:

* Tq == Tk (a prefill; the cache was empty): ``kernels/attention.py attention_prefill``, per
  batch row on q/k/v made [T, H, D]-contiguous (one copy, so the full layers meet the sm_90 Gluon
  kernel's layout; the sliding ones go to the Triton kernel), scale ``scaling``, window the layer's;
* 1 <= Tq <= MAX_DECODE_QUERIES < Tk (decode, or a few queries against a cache):
  ``kernels/attention_decode.py attention_decode`` on transformers' cache tensors as they are
  (``key.transpose(1, 2)`` is its [B, L, Hkv, D] layout with the last dim contiguous: no copy),
  every batch row ``Tk`` keys long (no padding), the window the layer's (the sliding layers' cache
  keeps the last window - 1 keys, so a single query sees all it returns; the key rows keep
  position order, so the window holds in row units).

Both compute the scores and the softmax with the sink in fp32, as our ``kernels`` mode does
(transformers' eager rounds the scores and the softmax to bf16). Everything else (padding, packed
sequences, extra mask functions, a static cache, training, other dtypes, another device) goes to
transformers' ``eager_attention_forward`` with eager's own mask, so results are never other than
eager's. ``CALLS`` counts the three routes and ``FALLBACKS`` the reasons (tests assert on them).
"""

from __future__ import annotations

from collections import Counter

import torch

from gptoss_fp8.errors import GptOssFp8Error

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        and_masks,
        causal_mask_function,
        eager_mask,
        prepare_padding_mask,
        sliding_window_overlay,
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
except ImportError:  # pragma: no cover - exercised only without the extra
    raise GptOssFp8Error("gptoss_fp8.hf needs transformers: pip install 'gptoss-fp8[hf]'") from None

NAME = "gptoss_fp8"  # the attn_implementation name
MAX_DECODE_QUERIES = 16  # new queries against a cache the decode kernel takes; longer chunks go to eager
HEAD_DIMS = (16, 32, 64, 128, 256)

CALLS: Counter = Counter()  # "prefill", "decode", "eager"
FALLBACKS: Counter = Counter()  # why a call went to eager


class PlainMask:
    """The mask transformers would build is the plain causal (window 0) or sliding-window causal
    pattern over ``kv_length`` keys, the ``q_length`` queries being the last positions, no padding.
    ``materialize()`` builds eager's float mask from the same arguments (for a fallback)."""

    def __init__(self, q_length: int, kv_length: int, window: int, kwargs: dict):
        self.q_length, self.kv_length, self.window = q_length, kv_length, window
        self._kwargs = kwargs
        self._eager: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        if self._eager is None:
            self._eager = eager_mask(**self._kwargs)
        return self._eager

    def __repr__(self) -> str:
        return f"PlainMask(q_length={self.q_length}, kv_length={self.kv_length}, window={self.window})"


def _closure(fn, name: str):
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


_AND_MASK = and_masks(causal_mask_function).__qualname__
_OVERLAY = sliding_window_overlay(1).__qualname__


def sliding_window_of(mask_function) -> int | None:
    """The window w when ``mask_function`` is transformers' ``sliding_window_causal_mask_function(w)``
    (``and_masks(sliding_window_overlay(w), causal_mask_function)``), else None."""
    try:
        if mask_function.__qualname__ != _AND_MASK:
            return None
        fns = _closure(mask_function, "mask_functions")
        if len(fns) != 2 or fns[1] is not causal_mask_function or fns[0].__qualname__ != _OVERLAY:
            return None
        w = _closure(fns[0], "sliding_window")
    except (AttributeError, ValueError, TypeError, IndexError):
        return None
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def plain_window(**kw) -> int | None:
    """The window (0: full causal) when the mask these ``mask_interface`` arguments describe is one
    our kernels compute without it (module docstring), else None."""
    if kw.get("use_vmap") or kw.get("block_sequence_ids") is not None:
        return None
    fn, local = kw.get("mask_function"), kw.get("local_size")
    if local is None:
        if fn is not causal_mask_function:
            return None
        window = 0
    else:
        window = sliding_window_of(fn)
        if window is None or window != local:
            return None
    sizes = [kw.get(k) for k in ("q_length", "kv_length", "q_offset", "kv_offset")]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        return None  # a static cache's tensor offset, or missing
    q_length, kv_length, q_offset, kv_offset = sizes
    if q_length < 1 or q_offset + q_length != kv_offset + kv_length:
        return None  # keys beyond the last query (a static cache's empty rows) or queries not at the end
    am = kw.get("attention_mask")
    if am is not None:
        if not isinstance(am, torch.Tensor) or am.dim() != 2 or am.dtype != torch.bool:
            return None
        pm = prepare_padding_mask(am, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
        if pm.shape[-1] != kv_length or not bool(pm.all()):  # one host read per mask: padding present?
            return None
    return window


def mask(**kw):
    """The mask function registered under ``NAME``: a ``PlainMask`` when our kernels need none,
    else eager's mask, built as eager's registry entry builds it."""
    window = plain_window(**kw)
    if window is None:
        return eager_mask(**kw)
    return PlainMask(kw["q_length"], kw["kv_length"], window, kw)


def _kernel_device(t: torch.Tensor) -> bool:
    from gptoss_fp8.model.triton_ops import _kernel_device as ok

    return ok(t)


_CONFIG = None


def _config():
    global _CONFIG
    if _CONFIG is None:
        from gptoss_fp8.model.triton_ops import default_config

        _CONFIG = default_config()
    return _CONFIG


def route(module, query, key, value, attention_mask, dropout, sliding_window, s_aux) -> str:
    """"prefill" or "decode" when a kernel takes the call, else the reason it goes to eager."""
    if not isinstance(attention_mask, PlainMask):
        return "mask"  # eager's own mask (padding, packing, ...), or one a caller passed
    b, hq, tq, d = query.shape
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] != b or key.shape[3] != d or hq % key.shape[1]:
        return "shape"
    tk = key.shape[2]
    window = sliding_window or 0
    if (attention_mask.q_length, attention_mask.kv_length, attention_mask.window) != (tq, tk, window):
        return "mask sizes"
    if (dropout or getattr(module, "training", False)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))):
        return "training"
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return "dtype"
    if d not in HEAD_DIMS or any(t.stride(-1) != 1 for t in (query, key, value)):
        return "head_dim"
    if s_aux is None or s_aux.shape != (hq,) or not s_aux.is_floating_point():
        return "sinks"
    if not _kernel_device(query) or key.device != query.device or value.device != query.device:
        return "device"
    if tq == tk:
        return "prefill"
    if tq <= MAX_DECODE_QUERIES:
        return "decode"
    return "chunk"


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, s_aux=None, **kwargs):
    """transformers' attention interface (module docstring): our kernels where they apply, else
    ``eager_attention_forward`` with eager's mask."""
    how = route(module, query, key, value, attention_mask, dropout, sliding_window, s_aux)
    CALLS[how if how in ("prefill", "decode") else "eager"] += 1
    if how not in ("prefill", "decode"):
        FALLBACKS[how] += 1
        m = attention_mask.materialize() if isinstance(attention_mask, PlainMask) else attention_mask
        return eager_attention_forward(module, query, key, value, m, scaling=scaling, dropout=dropout,
                                       sliding_window=sliding_window, s_aux=s_aux, **kwargs)
    window = sliding_window or 0
    sm_scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    sinks = s_aux.detach().contiguous()
    if how == "prefill":
        from gptoss_fp8.kernels.attention import attention_prefill

        outs = [attention_prefill(query[i].transpose(0, 1).contiguous(), key[i].transpose(0, 1).contiguous(),
                                  value[i].transpose(0, 1).contiguous(), sinks, sliding_window=window,
                                  sm_scale=sm_scale, config=_config())
                for i in range(query.shape[0])]
        return (outs[0][None] if len(outs) == 1 else torch.stack(outs)), None
    from gptoss_fp8.kernels.attention_decode import attention_decode

    b, tk = key.shape[0], key.shape[2]
    lens = torch.full((b,), tk, dtype=torch.int32, device=query.device)
    out = attention_decode(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), lens, sinks,
                           sliding_window=window, sm_scale=sm_scale, config=_config())
    return out, None


def register() -> None:
    """Register ``NAME`` in transformers' attention and mask registries (idempotent; on import)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask)


register()

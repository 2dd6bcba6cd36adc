"""Bugs injected into an ops backend, for the verdict's mutation suite (tests/test_verify_mutations.py).

Each mutation wraps a built backend (the w8a8 spec, or the triton kernels) in a subclass that
changes one thing, as a kernel bug would: the wrong bias, no clamp, no sinks, no window, no RoPE.
Used in-process and, by name (``ops_hook="mutations:<name>"``), in the worker processes of a
sharded run, so tests/ must be on their PYTHONPATH.
"""

from __future__ import annotations

import torch

MUTATIONS = ("no_gate_up_bias", "no_clamp", "double_down_bias", "no_sinks", "no_window", "no_rope",
             "double_sinks", "softmax_all_experts", "no_softmax")
# which part of a layer each bug shows up in first
PART_OF = {"no_gate_up_bias": "mlp", "no_clamp": "mlp", "double_down_bias": "mlp",
           "no_sinks": "attn", "no_window": "attn", "no_rope": "attn", "double_sinks": "attn",
           "softmax_all_experts": "combine", "no_softmax": "combine"}
TARGET_MODES = ("w8a8", "kernels")  # the backends a bug can go into


def _mutated(ops, name: str):
    base = type(ops)

    class Mutated(base):
        pass

    if name in ("no_gate_up_bias", "no_clamp", "double_down_bias"):
        def expert_ffn(self, x, idx, experts, first_expert, limit, partial=False, *, xq=None):
            ex = dict(experts)
            if name == "no_gate_up_bias":
                ex["gate_up_proj_bias"] = torch.zeros_like(ex["gate_up_proj_bias"])
            if name == "double_down_bias" and ex.get("down_proj_bias") is not None:
                ex["down_proj_bias"] = ex["down_proj_bias"] * 2
            if name == "no_clamp":
                limit = 1e30
            return base.expert_ffn(self, x, idx, ex, first_expert, limit, partial, xq=xq)

        Mutated.expert_ffn = expert_ffn
    elif name in ("no_sinks", "no_window", "double_sinks"):
        def attention(self, q, k, v, sinks, sm_scale, window, rope=None):
            if name == "no_sinks":
                sinks = torch.full_like(sinks, -1e4)  # exp(sink - max) = 0: the extra column is gone
            if name == "double_sinks":  # the sink's column counted twice: exp(s + ln 2) = 2 exp(s)
                sinks = (sinks.float() + 0.6931471805599453).to(sinks.dtype)
            return base.attention(self, q, k, v, sinks, sm_scale, 0 if name == "no_window" else window, rope=rope)

        Mutated.attention = attention
    elif name in ("softmax_all_experts", "no_softmax"):
        def route(self, x, weight, bias, top_k):
            g, ids, w = base.route(self, x, weight, bias, top_k)
            if name == "softmax_all_experts":  # the softmax over all E experts, then the top-k of it
                top = torch.topk(torch.softmax(g.float(), dim=-1), top_k, dim=-1, sorted=True)
                return g, top.indices.to(ids.dtype), top.values.to(w.dtype)
            top = torch.topk(g, top_k, dim=-1, sorted=True)  # no softmax: the raw logits as weights
            return g, top.indices.to(ids.dtype), top.values.to(w.dtype)

        Mutated.route = route
    elif name == "no_rope":
        Mutated.rope = lambda self, x, cos, sin: x
    else:
        raise ValueError(name)
    m = Mutated.__new__(Mutated)
    m.__dict__.update(ops.__dict__)
    return m


def hook(target: str, name: str):
    """An ops hook (``verify.run.resolve_ops_hook``) that injects bug ``name`` into mode ``target``."""
    def apply(mode, ops):
        return _mutated(ops, name) if mode == target else ops

    return apply


# module-level hooks by name, for worker processes too: ops_hook="mutations:kernels__no_sinks"
for _t in TARGET_MODES:
    for _n in MUTATIONS:
        globals()[f"{_t}__{_n}"] = hook(_t, _n)


def weights__ffn_scaled(mode, ops):
    """The weights mode's expert FFN output scaled by 1 + 5e-3 (a bug below the old 0.01 exact bound)."""
    if mode != "weights":
        return ops
    base = type(ops)

    class Scaled(base):
        def expert_ffn(self, *a, **kw):
            y, b = base.expert_ffn(self, *a, **kw)
            return y * (1 + 5e-3), b

    m = Scaled.__new__(Scaled)
    m.__dict__.update(ops.__dict__)
    return m

"""Shared by the peer tests (tests/test_prefill_peer.py, tests/test_decode_peer.py): our model
built so that a peer's agreement with it means something."""

from __future__ import annotations

import torch


def ours_with_sinks(cfg, device, seed=0):
    """Our model with random weights (FP8 attention and experts), sinks at the scale of trained
    ones (~N(0, 1)) so that a wrong sink treatment shows in the logits."""
    from gptoss_fp8.bench.prefill import random_model

    ours = random_model(cfg, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    for layer in ours.model.layers:
        a = layer.self_attn
        a.sinks = torch.randn(a.sinks.shape, generator=gen, device=device).to(torch.bfloat16)
    return ours

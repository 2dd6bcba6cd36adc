"""Triton kernels, one file each with its launcher and plain-torch reference; launcher helpers here."""

from __future__ import annotations

import functools

import torch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for persistent and split-KV grids; 4 off the GPU
    (the interpreter: a few programs still exercise the loops over tiles / splits)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    # get_device_properties costs ~20 us a call on the H200 machine (measured): once per device
    return torch.cuda.get_device_properties(index).multi_processor_count

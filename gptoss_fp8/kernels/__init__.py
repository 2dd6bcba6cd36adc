"""Triton kernels, one file each with its launcher and plain-torch reference; launcher helpers here."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for persistent and split-KV grids; 4 off the GPU
    (the interpreter: a few programs still exercise the loops over tiles / splits)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    # get_device_properties costs ~20 us a call on the H200 machine (measured): once per device
    return torch.cuda.get_device_properties(index).multi_processor_count


# ----------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL, Hopper): a kernel launched with it may be scheduled while the
# previous kernel in the stream is still finishing; its programs first wait for that kernel to
# complete (``griddepcontrol.wait``: every write of it visible), then allow the next kernel to be
# scheduled. So only launch latency and program start-up overlap the previous kernel's tail; no
# program reads or writes memory before its predecessor is done (a buffer the caching allocator
# hands over from a finished op is never touched early). Off in the interpreter and before sm_90.

PDL_ENABLED = os.environ.get("GPTOSS_FP8_PDL", "1") not in ("0", "")


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr that starts with ``pdl_prologue(PDL)``:
    ``{"PDL": True, "launch_pdl": True}`` on a Hopper-or-newer GPU (unless GPTOSS_FP8_PDL=0 or
    ``PDL_ENABLED`` is False), else none (the kernel's default PDL=False compiles it out)."""
    if not PDL_ENABLED or device.type != "cuda":
        return {}
    if not _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL kernel: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
